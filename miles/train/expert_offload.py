"""Expert offload: MoE expert weights, their gradients and optimizer state live in host memory.

Each expert is brought to the compute device when its forward runs and dropped right after; the
backward recomputes the expert (activation checkpointing) and brings its weights once more, so
at most one expert's weights are on the device at any moment, however many layers and experts
the model has. The gradient flows back through the copy to the host parameter, where the
optimizer (AdamW, whatever device its parameters are on) updates it. The price is one more
expert forward per backward and two host-to-device copies per expert and step.

On CPU the host and the device are the same memory; the copies are made anyway (clones), so the
mechanics and the residency bound run, and are tested, without a GPU.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint


class ExpertOffload:
    """`MoE.expert_loader`: runs an expert on weights brought to `device` for the call only, and
    counts the bytes of expert weights resident there (`resident`, `peak`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.resident = 0
        self.peak = 0

    def __call__(self, expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._run(expert, rows)
        return checkpoint(self._run, expert, rows, use_reentrant=False)

    def _run(self, expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        weights = {name: self._bring(p) for name, p in expert.named_parameters()}
        return functional_call(expert, weights, (rows,))

    def _bring(self, p: torch.Tensor) -> torch.Tensor:
        copy = p.clone() if p.device == self.device else p.to(self.device, non_blocking=True)
        size = copy.numel() * copy.element_size()
        self.resident += size
        self.peak = max(self.peak, self.resident)
        weakref.finalize(copy, self._release, size)
        return copy

    def _release(self, size: int) -> None:
        self.resident -= size


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if ".experts." in n]


def offload_experts(model: nn.Module) -> ExpertOffload:
    """Move every MoE expert's weights to host memory (pinned when the model is on a GPU) and
    route the experts through an `ExpertOffload` loader (in place)."""
    device = model.lm_head.weight.device
    for _, p in expert_parameters(model):
        if p.device.type != "cpu":
            p.data = p.data.cpu().pin_memory()
    loader = ExpertOffload(device)
    for module in model.modules():
        if hasattr(module, "expert_loader"):
            module.expert_loader = loader
    return loader
