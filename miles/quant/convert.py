"""Putting FP8 into a model: swap its projections for `FP8Linear` in place, by name.

The projections of attention and MLP/experts (`*_proj`) are converted; embeddings, lm_head,
norms and the MoE router stay in full precision, and so do layers matched by --fp8-skip-layers
(a pattern that matches no layer is an error naming it). The trainer keeps fp32 master weights
(the same Parameters, so optimizer, DDP/FSDP and checkpoints see nothing new); the engine stores
float8 codes. Unified FP8 (--fp8-recipe alone) converts both; --fp8-rollout-only converts the
engine only, to show the mismatch unified FP8 removes.
"""

from __future__ import annotations

import fnmatch
import logging

import torch.nn as nn

from miles.errors import ConfigError
from miles.quant.linear import FP8Linear, FP8Spec

QUANTIZED = "*_proj"  # q/k/v/o, gate/up/down (dense MLP and experts); never mlp.gate (the router)
log = logging.getLogger("miles")


def skip_patterns(text: str | None) -> tuple[str, ...]:
    """--fp8-skip-layers "lm_head,embed" -> glob patterns matched anywhere in a layer's name."""
    return tuple(f"*{p.strip()}*" for p in (text or "").split(",") if p.strip())


def to_fp8(
    model: nn.Module, spec: FP8Spec, skip: tuple[str, ...] = (), store_codes: bool = False, mode: str = "fp8"
) -> list[str]:
    """Swap `model`'s projections for FP8Linear in place; returns the names swapped."""
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
        setattr(owner, attr, FP8Linear(getattr(owner, attr), spec, store_codes=store_codes, mode=mode))
    return chosen


def fp8_layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def spec_for(precision) -> FP8Spec | None:
    """The run's FP8Spec (PrecisionSection), or None without FP8. The scale format was read from
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES once, in the driver, into the config every worker gets."""
    if not precision.fp8_recipe:
        return None
    return FP8Spec(
        precision.fp8_recipe,
        precision.fp8_fp32_scales,
        precision.fp8_format or "e4m3",
        precision.fp8_dynamic_scaling,
    )


def start_mode(cfg) -> str:
    """bf16 for the first --warmup-steps rollouts with --warmup-precision bf16, else fp8."""
    return "bf16" if cfg.train.warmup_precision == "bf16" and cfg.train.warmup_steps > 0 else "fp8"


def mode_at(cfg, rollout_id: int) -> str:
    return "bf16" if start_mode(cfg) == "bf16" and rollout_id < cfg.train.warmup_steps else "fp8"


def prepare_rollout_model(model: nn.Module, cfg) -> nn.Module:
    """The engine's model: FP8 projections (codes) with unified FP8 or --fp8-rollout-only."""
    spec = spec_for(cfg.precision)
    if spec is not None:
        swapped = to_fp8(model, spec, skip_patterns(cfg.precision.fp8_skip_layers), True, start_mode(cfg))
        log.info(
            "FP8 rollout engine: %d projections as float8 codes, %s scaling, %s scales, %s format%s",
            len(swapped), spec.recipe, "FP32" if spec.fp32_scales else "power-of-two", spec.fmt,
            "" if cfg.precision.fp8_rollout_only else " (the trainer quantizes the same way)",
        )  # fmt: skip
    return model


def prepare_train_model(model: nn.Module, cfg) -> nn.Module:
    """The trainer's model: FP8 forward GEMMs over fp32 master weights with unified FP8."""
    spec = spec_for(cfg.precision)
    if spec is not None and not cfg.precision.fp8_rollout_only:
        to_fp8(model, spec, skip_patterns(cfg.precision.fp8_skip_layers), False, start_mode(cfg))
    return model


def set_mode(model: nn.Module, mode: str) -> int:
    """Switch every FP8 layer of `model` to `mode` (bf16 | fp8); returns how many switched."""
    layers = [m for m in fp8_layers(model) if m.mode != mode]
    for layer in layers:
        layer.set_mode(mode)
    return len(layers)


def fp8_metrics(model: nn.Module) -> dict[str, float]:
    """fp8_flush_frac (nonzero inputs quantized to zero) and fp8_saturation_frac (inputs above a
    delayed scale's amax, clipped) since the last call, over the trainer's FP8 layers."""
    layers = [m for m in fp8_layers(model) if m.track]
    if not layers:
        return {}
    total = {k: sum(m.stats[k] for m in layers) for k in ("flushed", "saturated", "elements")}
    for m in layers:
        m.stats = dict.fromkeys(m.stats, 0)
    n = max(total["elements"], 1)
    return {"fp8_flush_frac": total["flushed"] / n, "fp8_saturation_frac": total["saturated"] / n}


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the FP8 layers' stored weights and scales, bytes they would take in fp32)."""
    stored = fp32 = 0
    for m in fp8_layers(model):
        stored += m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4
        fp32 += m.weight.numel() * 4
    return stored, fp32


__all__ = [
    "FP8Linear",
    "FP8Spec",
    "fp8_layers",
    "fp8_metrics",
    "prepare_rollout_model",
    "prepare_train_model",
    "set_mode",
    "to_fp8",
]
