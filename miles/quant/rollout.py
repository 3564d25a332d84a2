"""An FP8 rollout engine with a full-precision trainer (--fp8-rollout-only): the engine's
projections compute with FP8-rounded weights and activations (W8A8, emulated by quantize ->
dequantize on CPU), which is the train/rollout mismatch that low-precision inference brings and
that R3, TIS and a unified precision correct or remove.

`fp8_rollout_model` swaps the engine model's projections for `FP8Linear` in place; the weight
Parameters stay the same objects, so weight sync still copies into them, and each layer
re-quantizes its weight when the weight changes. Embeddings, lm_head, norms and the MoE router
stay in full precision, and so do layers matched by --fp8-skip-layers.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.errors import ConfigError
from miles.quant.fp8 import FP8Recipe, fake_quantize, fake_quantize_activation

QUANTIZED = "*_proj"  # q/k/v/o, gate/up/down (dense MLP and experts); never mlp.gate (the router)


class FP8Linear(nn.Module):
    """y = fq(x) @ fq(W)^T + b, with the weight's quantization cached until the weight changes."""

    def __init__(self, linear: nn.Linear, recipe: FP8Recipe) -> None:
        super().__init__()
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe
        self._cached: tuple[int, int, torch.Tensor] | None = None

    def quantized_weight(self) -> torch.Tensor:
        key = (self.weight._version, self.weight.data_ptr())
        if self._cached is None or self._cached[:2] != key:
            self._cached = (*key, fake_quantize(self.weight.detach(), self.recipe))
        return self._cached[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quantize_activation(x, self.recipe), self.quantized_weight(), self.bias)


def skip_patterns(text: str | None) -> tuple[str, ...]:
    """--fp8-skip-layers "lm_head,embed" -> glob patterns matched anywhere in a layer's name."""
    return tuple(f"*{p.strip()}*" for p in (text or "").split(",") if p.strip())


def fp8_rollout_model(model: nn.Module, recipe: FP8Recipe, skip: tuple[str, ...] = ()) -> list[str]:
    """Swap `model`'s projections for FP8Linear in place; returns the names swapped. Each
    --fp8-skip-layers pattern must match some layer (a typo would silently keep it in FP8)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for pattern in skip:
        if not any(fnmatch.fnmatch(n, pattern) for n in names):
            raise ConfigError(
                f"--fp8-skip-layers: {pattern.strip('*')!r} matches no layer of this model (names look like {names[0]!r})"
            )
    chosen = [
        n for n in names if fnmatch.fnmatch(n, QUANTIZED) and not any(fnmatch.fnmatch(n, p) for p in skip)
    ]
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, FP8Linear(getattr(owner, attr), recipe))
    return chosen


def prepare_rollout_model(model: nn.Module, precision) -> nn.Module:
    """The engine's model for the run's PrecisionSection: FP8 projections with --fp8-rollout-only
    (the recipe and the scale format, NVTE_FP8_BLOCK_SCALING_FP32_SCALES, read here once: the
    driver's reading travels to Ray engines inside the config)."""
    if precision.fp8_rollout_only:
        recipe = FP8Recipe(precision.fp8_recipe, fp32_scales=precision.fp8_fp32_scales)
        swapped = fp8_rollout_model(model, recipe, skip_patterns(precision.fp8_skip_layers))
        logging.getLogger("miles").info(
            "FP8 rollout: %d projections, %s scaling, %s scales; trainer in full precision",
            len(swapped),
            recipe.granularity,
            "FP32" if recipe.fp32_scales else "power-of-two",
        )
    return model
