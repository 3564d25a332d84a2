"""RMSNorm and RoPE with hand-written backwards; on CPU in fp32 one C++ pass each way (row_ops.cpp).

Autograd through the composite (fp32 cast, square, mean, rsqrt, two products) runs five
operators forward and about eight backward, each a pass over the activations with its own
temporary; a norm runs two to four times a layer on every token, so on a CPU training step these
passes cost more than the GEMMs they sit between. Elsewhere (a GPU, bf16) the same formula runs
as torch operators with the same hand-written backward. Each row's result is its own, so it does
not depend on the batch (the trainer and the engine's general step agree bitwise). RoPE likewise:
four operators and a concatenation each way become one pass, which also writes the head-major
layout attention reads.
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

SOURCE = Path(__file__).with_name("row_ops.cpp")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where none can be built (the torch operators serve)."""
    try:
        lib = build(SOURCE, "row_ops", "the CPU RMSNorm and RoPE kernels")
    except RuntimeError as e:
        log.info("RMSNorm and RoPE run as torch operators: %s", str(e).splitlines()[0])
        return None
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.miles_rms_norm_forward.argtypes = [n, n, p, p, ctypes.c_double, p, p, n]
    lib.miles_rms_norm_backward.argtypes = [n, n, p, p, p, p, p, p, n]
    lib.miles_rope.argtypes = [n, n, n, n, p, n, n, n, p, p, p, n, n, n, n, n]
    return lib


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, where every operand is an fp32 CPU tensor and they are built."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the half-split convention of Llama/Qwen; cos, sin (B, T, D)."""
    if x.stride(-1) == 1 and _native(x, cos, sin) is not None:
        return _Rope.apply(x, cos.contiguous(), sin.contiguous())
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool
) -> torch.Tensor:
    B, H, T, D = x.shape
    lib = _library()
    lib.miles_rope(
        B, H, T, D, x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        *out.stride()[:3], int(inverse), torch.get_num_threads(),
    )  # fmt: skip
    return out


class _Rope(torch.autograd.Function):
    """RoPE as one C++ pass each way; the result head-major (contiguous (B, H, T, D)), the input's
    gradient in the input's own layout."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not _dense(x):  # broadcast or sliced: its strides cannot hold a gradient
            x = x.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.x_stride = x.stride()
        return _rotate(x, cos, sin, torch.empty(x.shape), inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        out = torch.empty_strided(grad.shape, ctx.x_stride)  # the layout the input came in
        return _rotate(grad, cos, sin, out, inverse=True), None, None


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill its memory exactly once in some order of its dimensions."""
    expected = 1
    for i in sorted(range(x.dim()), key=x.stride):
        if x.size(i) != 1 and x.stride(i) != expected:
            return False
        expected *= x.size(i)
    return True
