"""FP8 quantization: E4M3 (max 448, 3 mantissa bits) for weights and activations, E5M2 (max
57344, 2 mantissa bits) for gradients in the hybrid format.

A scale maps a tensor (tensorwise), a 128x128 weight block (blockwise) or a 1x128 activation tile
onto the format's range: scale = amax / max (amax floored at a tiny epsilon, so an all-zero block
does not divide by zero) and codes = clamp(x / scale, -max, max) cast to the float8 dtype. Scales
are rounded up to a power of two (exact to apply, as Transformer Engine does by default) unless
FP32 scales are asked for (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1). One outlier in a tensorwise
tensor shrinks every other element towards (or below) the format's smallest step; a block
confines it to its tile. Blocks that do not divide a dimension are partial (ceiling division).
Delayed scaling takes amax from the previous steps (an amax history) instead of the tensor itself,
so an element above that amax saturates at the format's max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
AMAX_FLOOR = 1e-12
BLOCK = 128
FORMATS = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, E5M2_MAX)}


@dataclass(frozen=True)
class FP8Recipe:
    """`granularity`: tensorwise | blockwise; `fp32_scales` False rounds each scale up to a power
    of two; `fmt`: the float8 format of the values (e4m3 or e5m2)."""

    granularity: str = "blockwise"
    fp32_scales: bool = False
    fmt: str = "e4m3"
    block: int = BLOCK

    @property
    def max(self) -> float:
        return FORMATS[self.fmt][1]

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.fmt][0]


def scale_for(amax: torch.Tensor, recipe: FP8Recipe) -> torch.Tensor:
    scale = amax.float().clamp(min=AMAX_FLOOR) / recipe.max
    if not recipe.fp32_scales:  # the next power of two at or above: codes still fit in the range
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Max |x| of each (block x block) tile of a 2-D tensor, partial tiles included: (ceil(R/b), ceil(C/b))."""
    rows, cols = x.shape
    pad = x.new_zeros(math.ceil(rows / block) * block, math.ceil(cols / block) * block)
    pad[:rows, :cols] = x.detach().abs()
    return pad.reshape(pad.shape[0] // block, block, pad.shape[1] // block, block).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    if scale.dim() == 0:
        return scale
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def quantize(
    x: torch.Tensor, recipe: FP8Recipe, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in the recipe's float8 dtype, scales) of a weight: one scale for tensorwise (or
    when `amax` is given: delayed scaling), one per 128x128 block for blockwise."""
    x = x.detach().float()
    if amax is not None or recipe.granularity == "tensorwise" or x.dim() != 2:
        scale = scale_for(x.abs().amax() if amax is None else amax, recipe)
    elif recipe.granularity == "blockwise":
        scale = scale_for(block_amax(x, recipe.block), recipe)
    else:
        raise ValueError(f"FP8 recipe {recipe.granularity!r} is not tensorwise or blockwise")
    codes = (x / _expand(scale, x.shape, recipe.block)).clamp(-recipe.max, recipe.max).to(recipe.dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, recipe: FP8Recipe) -> torch.Tensor:
    return codes.float() * _expand(scale, codes.shape, recipe.block)


def fake_quantize(x: torch.Tensor, recipe: FP8Recipe, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to what FP8 can hold, back in x's dtype (the CPU emulation of a weight)."""
    codes, scale = quantize(x, recipe, amax)
    return dequantize(codes, scale, recipe).to(x.dtype)


def fake_quantize_activation(
    x: torch.Tensor, recipe: FP8Recipe, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """Activations (and gradients): blockwise scales each 1 x 128 tile of the last dimension (one
    token's 128 channels), tensorwise the whole tensor (so one outlier token sets every token's
    scale); `amax` given: one delayed scale for the whole tensor."""
    if x.numel() == 0:  # an expert that got no tokens
        return x
    if amax is not None or recipe.granularity == "tensorwise":
        scale = scale_for(x.detach().abs().amax() if amax is None else amax, recipe).to(x.dtype)
        return (x / scale).clamp(-recipe.max, recipe.max).to(recipe.dtype).to(x.dtype) * scale
    b, cols = recipe.block, x.shape[-1]
    tiles = math.ceil(cols / b)
    padded = torch.nn.functional.pad(x, (0, tiles * b - cols)).reshape(*x.shape[:-1], tiles, b)
    scale = scale_for(padded.detach().abs().amax(-1, keepdim=True), recipe).to(x.dtype)
    q = (padded / scale).clamp(-recipe.max, recipe.max).to(recipe.dtype).to(x.dtype) * scale
    return q.reshape(*x.shape[:-1], tiles * b)[..., :cols]


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 and back (the CPU emulation of a bf16 GEMM input)."""
    return x.to(torch.bfloat16).to(x.dtype)


def underflow_fraction(x: torch.Tensor, recipe: FP8Recipe) -> float:
    """Fraction of nonzero elements of a weight that quantize to zero (flushed by too large a scale)."""
    codes, _ = quantize(x, recipe)
    nonzero = x.detach() != 0
    return float(((codes.float() == 0) & nonzero).sum() / nonzero.sum().clamp(min=1))
