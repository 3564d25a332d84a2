"""--optimizer-cpu-offload: AdamW whose state lives in host memory.

On a GPU, AdamW's two moments take twice the weights' bytes. Here they stay on the host with a
host copy of the weights: each step brings the weights and gradients over, updates the host copy there and
copies the weights back. The device then holds weights and gradients only, at the price of three
transfers of the weights' size a step and a CPU update (DeepSpeed's ZeRO-Offload, without its fused
CPU kernel). A CPU run already keeps everything in host memory: the run uses plain AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over host copies of `params`; `step` moves gradients in and weights out.
    Its state dict is AdamW's, so checkpoints load either way."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **options) -> None:
        self.device_params = [p for p in params if p.requires_grad]
        pin = torch.cuda.is_available()
        host = []
        for p in self.device_params:
            copy = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
            copy.copy_(p.detach())
            host.append(torch.nn.Parameter(copy))
        super().__init__(host, **options)

    @property
    def host_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for device, host in zip(self.device_params, self.host_params):
            host.copy_(device, non_blocking=True)  # the device's weights are the truth (a resume loads them)
            host.grad = None if device.grad is None else device.grad.to(host.device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loss = super().step(closure)
        for device, host in zip(self.device_params, self.host_params):
            device.copy_(host, non_blocking=True)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
