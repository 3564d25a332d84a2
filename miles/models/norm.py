"""RMSNorm, with a hand-written backward; on CPU in fp32 one C++ pass a row each way (norm.cpp).

Autograd through the composite (fp32 cast, square, mean, rsqrt, two products) runs five
operators forward and about eight backward, each a pass over the activations with its own
temporary; a norm runs two to four times a layer on every token, so on a CPU training step these
passes cost more than the GEMMs they sit between. Elsewhere (a GPU, bf16) the same formula runs
as torch operators with the same hand-written backward. Each row's result is its own, so it does
not depend on the batch (the trainer and the engine's general step agree bitwise).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn as nn

from miles.native import build

log = logging.getLogger("miles")

SOURCE = Path(__file__).with_name("norm.cpp")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where none can be built (the torch operators serve)."""
    try:
        lib = build(SOURCE, "rms_norm", "the CPU RMSNorm kernels")
    except RuntimeError as e:
        log.info("RMSNorm runs as torch operators: %s", str(e).splitlines()[0])
        return None
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.miles_rms_norm_forward.argtypes = [n, n, p, p, ctypes.c_double, p, p, n]
    lib.miles_rms_norm_backward.argtypes = [n, n, p, p, p, p, p, p, n]
    return lib


def _native(x: torch.Tensor, weight: torch.Tensor) -> ctypes.CDLL | None:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    return _library()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """weight * x / rms(x), rms in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.dtype = x.dtype
        lib = _native(x, weight)
        if lib is not None:
            x = x.contiguous()
            C = x.shape[-1]
            out, rstd = torch.empty_like(x), torch.empty(x.numel() // C)
            w = weight.detach().contiguous()
            lib.miles_rms_norm_forward(
                rstd.numel(), C, x.data_ptr(), w.data_ptr(), eps, out.data_ptr(), rstd.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            ctx.save_for_backward(x, rstd, weight)
            ctx.native = True
            return out
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        normed = h * rstd
        ctx.save_for_backward(normed, rstd, weight)
        ctx.native = False
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad_weight = None
        wants_x, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.native:
            x, rstd, weight = ctx.saved_tensors
            grad = grad.contiguous()
            C = x.shape[-1]
            grad_x = torch.empty_like(x) if wants_x else None
            grad_weight = torch.zeros(C) if wants_weight else None
            lib = _library()
            lib.miles_rms_norm_backward(
                rstd.numel(), C, grad.data_ptr(), x.data_ptr(), weight.detach().contiguous().data_ptr(),
                rstd.data_ptr(), grad_x.data_ptr() if wants_x else None,
                grad_weight.data_ptr() if wants_weight else None, torch.get_num_threads(),
            )  # fmt: skip
            return grad_x, grad_weight, None
        normed, rstd, weight = ctx.saved_tensors
        g = grad.float()
        if wants_weight:
            seen = normed.to(ctx.dtype).float()  # what the weight multiplied (rounded as forward did)
            grad_weight = (g * seen).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        if wants_x:
            gn = g * weight.float()  # d/d(normed); normed = x * rstd, rstd = mean(x^2)^(-1/2)
            grad_x = ((gn - normed * (gn * normed).mean(-1, keepdim=True)) * rstd).to(ctx.dtype)
        return grad_x, grad_weight, None
