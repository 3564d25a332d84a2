"""Putting low precision into a model: swap its projections for `FP8Linear` or `Int4Linear` in
place, by name.

The projections of attention and MLP/experts (`*_proj`) are converted; embeddings, lm_head,
norms and the MoE router stay in full precision, and so do layers matched by --fp8-skip-layers /
--int4-skip-layers (a pattern that matches no layer is an error naming it). The trainer keeps fp32
master weights (the same Parameters, so optimizer, DDP/FSDP and checkpoints see nothing new); the
engine stores float8 codes or packed INT4. Unified FP8 (--fp8-recipe) and INT4 QAT (--int4-qat)
convert both; --fp8-rollout-only / --int4-rollout-only convert the engine only, to show the
mismatch that quantizing both sides removes.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Callable

import torch.nn as nn

from miles.errors import ConfigError
from miles.models.routing import apply_routing, routing_options
from miles.quant.fp8_linear import FP8Linear, FP8Spec, QuantizedLinear
from miles.quant.int4 import divisors
from miles.quant.int4_linear import Int4Linear

QUANTIZED = "*_proj"  # q/k/v/o, gate/up/down (dense MLP and experts); never mlp.gate (the router)
INT4_ENV = ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE")
log = logging.getLogger("miles")


def skip_patterns(text: str | None) -> tuple[str, ...]:
    """--fp8-skip-layers "lm_head,embed" -> glob patterns matched anywhere in a layer's name."""
    return tuple(f"*{p.strip()}*" for p in (text or "").split(",") if p.strip())


def quantized_names(
    model: nn.Module, skip: tuple[str, ...] = (), flag: str = "--fp8-skip-layers"
) -> list[str]:
    """The projections a low-precision run converts: `*_proj` linears not matched by `skip`."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    everything = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    for pattern in skip:
        if not any(_matches(n, pattern) for n in everything):
            raise ConfigError(
                f"{flag}: {pattern.strip('*')!r} matches no layer of this model (names look like {names[0]!r})"
            )
    return [
        n for n in names if fnmatch.fnmatch(n, QUANTIZED) and not any(fnmatch.fnmatch(n, p) for p in skip)
    ]


def _matches(name: str, pattern: str) -> bool:
    """A glob match, also with underscores ignored: Megatron's "layer_norm" names HF's "layernorm"."""
    return fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name.replace("_", ""), pattern.replace("_", ""))


def swap_linears(model: nn.Module, names: list[str], make: Callable[[nn.Linear], nn.Module]) -> list[str]:
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, make(getattr(owner, attr)))
    return names


def to_fp8(
    model: nn.Module, spec: FP8Spec, skip: tuple[str, ...] = (), store_codes: bool = False, mode: str = "fp8"
) -> list[str]:
    """Swap `model`'s projections for FP8Linear in place; returns the names swapped."""
    return swap_linears(
        model,
        quantized_names(model, skip),
        lambda lin: FP8Linear(lin, spec, store_codes=store_codes, mode=mode),
    )


def check_int4_group(model: nn.Module, group: int, skip: tuple[str, ...] = ()) -> list[str]:
    """The projections INT4 would quantize; a group size that does not divide one of their input
    sizes is an error naming the layer and the sizes that would do."""
    names = quantized_names(model, skip, "--int4-skip-layers")
    sizes = {n: model.get_submodule(n).in_features for n in names}
    bad = [n for n, size in sizes.items() if size % group]
    if bad:
        ok = divisors(sorted(set(sizes.values())))
        raise ConfigError(
            f"--int4-group-size {group} does not divide the input size {sizes[bad[0]]} of {bad[0]} "
            f"({len(bad)} layer(s) like it); group sizes that divide every quantized layer of this model: "
            f"{', '.join(map(str, ok)) or 'none (skip the odd layers with --int4-skip-layers)'}"
        )
    return names


def to_int4(
    model: nn.Module,
    group: int,
    skip: tuple[str, ...] = (),
    store_packed: bool = False,
    mode: str = "int4",
    activations: str = "fp32",
) -> list[str]:
    """Swap `model`'s projections for Int4Linear in place; returns the names swapped."""
    return swap_linears(
        model,
        check_int4_group(model, group, skip),
        lambda lin: Int4Linear(lin, group, store_packed=store_packed, mode=mode, activations=activations),
    )


def fp8_layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def quant_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


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


def low_precision(cfg) -> str | None:
    """fp8 | int4 | None: the format of the run's quantized layers."""
    if cfg.precision.int4_qat or cfg.precision.int4_rollout_only:
        return "int4"
    return "fp8" if cfg.precision.fp8_recipe else None


def start_mode(cfg) -> str:
    """bf16 for the first --warmup-steps rollouts with --warmup-precision bf16, else fp8/int4."""
    if cfg.train.warmup_precision == "bf16" and cfg.train.warmup_steps > 0:
        return "bf16"
    return low_precision(cfg) or "fp8"


def mode_at(cfg, rollout_id: int) -> str:
    if start_mode(cfg) == "bf16" and rollout_id < cfg.train.warmup_steps:
        return "bf16"
    return low_precision(cfg) or "fp8"


def _int4_skip(cfg) -> tuple[str, ...]:
    return skip_patterns(cfg.precision.int4_skip_layers)


def prepare_rollout_model(model: nn.Module, cfg) -> nn.Module:
    """The engine's model: FP8 codes (unified FP8, --fp8-rollout-only) or packed INT4 (--int4-qat,
    --int4-rollout-only) for its projections."""
    precision = cfg.precision
    apply_routing(model, routing_options(cfg))
    if low_precision(cfg) == "int4":
        swapped = to_int4(
            model, precision.int4_group_size, _int4_skip(cfg), True, start_mode(cfg),
            precision.int4_kernel_activations,
        )  # fmt: skip
        kernel = sum(model.get_submodule(n).kernel for n in swapped)
        log.info(
            "INT4 rollout engine: %d projections as packed INT4 (group %d), %d on the INT4 kernel with %s "
            "activations%s", len(swapped), precision.int4_group_size, kernel, precision.int4_kernel_activations,
            "" if precision.int4_qat else " (the trainer stays full precision)",
        )  # fmt: skip
        return model
    spec = spec_for(precision)
    if spec is not None:
        swapped = to_fp8(model, spec, skip_patterns(precision.fp8_skip_layers), True, start_mode(cfg))
        log.info(
            "FP8 rollout engine: %d projections as float8 codes, %s scaling, %s scales, %s format%s",
            len(swapped), spec.recipe, "FP32" if spec.fp32_scales else "power-of-two", spec.fmt,
            "" if precision.fp8_rollout_only else " (the trainer quantizes the same way)",
        )  # fmt: skip
    return model


def quantize_train_model(model: nn.Module, cfg) -> nn.Module:
    """The trainer's model: FP8 forward GEMMs (unified FP8) or INT4 fake-quant weights (--int4-qat)
    over fp32 master weights, and the run's routing options."""
    precision = cfg.precision
    spec = spec_for(precision)
    if precision.int4_qat:
        to_int4(model, precision.int4_group_size, _int4_skip(cfg), False, start_mode(cfg))
    elif spec is not None and not precision.fp8_rollout_only:
        to_fp8(model, spec, skip_patterns(precision.fp8_skip_layers), False, start_mode(cfg))
    apply_routing(model, routing_options(cfg))  # after the swaps: only full-precision layers are tiled
    return model


def check_at_start(model: nn.Module, cfg) -> None:
    """In the driver, before any worker starts: the skip patterns and the INT4 group size against
    the model, and one line saying what the run quantizes (with where its settings came from)."""
    precision = cfg.precision
    kind = low_precision(cfg)
    if kind == "fp8":
        quantized_names(model, skip_patterns(precision.fp8_skip_layers))
    if kind != "int4":
        return
    names = check_int4_group(model, precision.int4_group_size, _int4_skip(cfg))
    env = {v: os.environ.get(v) for v in INT4_ENV if os.environ.get(v)}
    log.info(
        "INT4: %s, group size %d, %d projections%s",
        "QAT in the trainer, packed INT4 in the engines" if precision.int4_qat else "packed INT4 in the engines only",
        precision.int4_group_size, len(names),
        f" (from the environment: {', '.join(f'{k}={v}' for k, v in env.items())})" if env else "",
    )  # fmt: skip
    if not precision.int4_qat:
        log.warning(
            "--int4-rollout-only: the engines hold INT4 weights, but training still holds full-precision weights, "
            "gradients and optimizer state, and its log-probs differ from the engine's; set "
            "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 (or --int4-qat) to train on the same INT4 grid"
        )


def set_mode(model: nn.Module, mode: str) -> int:
    """Switch every quantized layer of `model` to `mode` (bf16 | fp8 | int4); returns how many."""
    layers = [m for m in quant_layers(model) if m.mode != mode]
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
    """(bytes of the quantized layers' stored weights and scales, bytes they would take in fp32)."""
    stored = fp32 = 0
    for m in quant_layers(model):
        for t in (m.weight, getattr(m, "weight_scale", None)):
            stored += 0 if t is None else t.numel() * t.element_size()
        fp32 += m.in_features * m.out_features * 4
    return stored, fp32


__all__ = [
    "FP8Linear",
    "Int4Linear",
    "FP8Spec",
    "fp8_layers",
    "fp8_metrics",
    "prepare_rollout_model",
    "quantize_train_model",
    "set_mode",
    "to_fp8",
    "to_int4",
]
