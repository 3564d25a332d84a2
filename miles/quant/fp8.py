"""FP8 (E4M3) quantization with one scale per tensor (tensorwise) or per 128x128 block (blockwise).

E4M3 holds magnitudes up to 448 with 3 mantissa bits. A block's scale is amax / 448 (amax floored
at a tiny epsilon, so an all-zero block does not divide by zero); codes are
clamp(x / scale, -448, 448) cast to `float8_e4m3fn`. Scales are rounded up to a power of two (exact
to apply, as Transformer Engine does by default) unless FP32 scales are asked for
(NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1). One outlier in a tensorwise-scaled tensor shrinks every
other element towards (or below) E4M3's smallest step; a block confines it to its 128x128 tile.
Blocks that do not divide a dimension are partial (ceiling division).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12
BLOCK = 128
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


@dataclass(frozen=True)
class FP8Recipe:
    """How weights are scaled: `granularity` tensorwise | blockwise; `fp32_scales` False rounds
    each scale up to a power of two."""

    granularity: str = "blockwise"
    fp32_scales: bool = False
    block: int = BLOCK

    @classmethod
    def from_env(cls, granularity: str) -> FP8Recipe:
        """The recipe for --fp8-recipe, with the scale format from the environment (read once, in
        the driver; the recipe object then travels to every worker, so workers need not see it)."""
        return cls(granularity, fp32_scales=os.environ.get(FP32_SCALES_ENV, "0") == "1")


def _scale(amax: torch.Tensor, fp32_scales: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    if not fp32_scales:  # the next power of two at or above: codes still fit in +-448
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Max |x| of each (block x block) tile of a 2-D tensor, partial tiles included: (ceil(R/b), ceil(C/b))."""
    rows, cols = x.shape
    pad = torch.zeros(math.ceil(rows / block) * block, math.ceil(cols / block) * block, dtype=x.dtype)
    pad[:rows, :cols] = x.abs()
    return pad.reshape(pad.shape[0] // block, block, pad.shape[1] // block, block).amax(dim=(1, 3))


def quantize(x: torch.Tensor, recipe: FP8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as float8_e4m3fn, scales): one scale for tensorwise, one per tile for blockwise."""
    x = x.detach().float().cpu() if x.device.type != "cpu" else x.detach().float()
    if recipe.granularity == "tensorwise" or x.dim() != 2:
        scale = _scale(x.abs().amax(), recipe.fp32_scales)
        full = scale
    elif recipe.granularity == "blockwise":
        scale = _scale(block_amax(x, recipe.block), recipe.fp32_scales)
        b = recipe.block
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[: x.shape[0], : x.shape[1]]
    else:
        raise ValueError(f"FP8 recipe {recipe.granularity!r} is not tensorwise or blockwise")
    codes = (x / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, recipe: FP8Recipe) -> torch.Tensor:
    values = codes.float()
    if scale.dim() == 0:
        return values * scale
    b = recipe.block
    return (
        values * scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[: values.shape[0], : values.shape[1]]
    )


def fake_quantize(x: torch.Tensor, recipe: FP8Recipe) -> torch.Tensor:
    """x rounded to what FP8 can hold, back in x's dtype and device (the CPU emulation)."""
    codes, scale = quantize(x, recipe)
    return dequantize(codes, scale, recipe).to(dtype=x.dtype, device=x.device)


def underflow_fraction(x: torch.Tensor, recipe: FP8Recipe) -> float:
    """Fraction of nonzero elements that quantize to zero (flushed by too large a scale)."""
    codes, _ = quantize(x, recipe)
    nonzero = x.detach().cpu() != 0
    return float(((codes.float() == 0) & nonzero).sum() / nonzero.sum().clamp(min=1))


def fake_quantize_activation(x: torch.Tensor, recipe: FP8Recipe) -> torch.Tensor:
    """Activations: blockwise scales each 1 x 128 tile of the last dimension (one token's 128
    channels), tensorwise the whole tensor (so one outlier token sets every token's scale)."""
    if recipe.granularity == "tensorwise":
        scale = _scale(x.detach().abs().amax(), recipe.fp32_scales)
        return ((x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)) * scale
    b, cols = recipe.block, x.shape[-1]
    tiles = math.ceil(cols / b)
    padded = torch.nn.functional.pad(x, (0, tiles * b - cols)).reshape(*x.shape[:-1], tiles, b)
    scale = _scale(padded.detach().abs().amax(-1, keepdim=True), recipe.fp32_scales).to(x.dtype)
    q = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return q.reshape(*x.shape[:-1], tiles * b)[..., :cols]
