"""LoRA adapters on a miles `Transformer`: W x + (alpha / r) * B A dropout(x) on chosen projections.

Each adapted projection (a `nn.Linear`, or an FP8/INT4 layer: the adapter then runs in full
precision over the quantized base, as QLoRA does) gets two parameters, `lora_A` (r, in) and
`lora_B` (out, r), and a forward hook that adds the low-rank term. The base weights stay where
they are, frozen, under their Hugging Face names, so everything that reads the base (checkpoints,
the engine, expert offload, FSDP units) works unchanged. A starts Kaiming-uniform and B at zero,
so a fresh adapter leaves the model's outputs as they were.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.errors import ConfigError

# Every projection of attention and the MLP (dense, experts, shared expert); never lm_head or a
# MoE router (`mlp.gate`, `shared_expert_gate`): suffixes match as PEFT's target_modules list does.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False  # PEFT's use_rslora: scale alpha / sqrt(r) instead of alpha / r

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def parse_targets(text: str) -> tuple[str, ...]:
    """`--lora-target-modules`: comma-separated module names (suffixes), or all-linear."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise ConfigError(
            "--lora-target-modules is empty; give module names such as q_proj,v_proj or all-linear"
        )
    return names


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer that may carry an adapter, by qualified name (lm_head excluded)."""
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features") and name and name != "lm_head"
    }


def matches(name: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of target names: the full name, or its last dotted parts."""
    if "all-linear" in targets:
        return True
    return any(name == t or name.endswith("." + t) for t in targets)


def target_modules(model: nn.Module, spec: LoraSpec) -> dict[str, nn.Module]:
    """The projections `spec` adapts; a target naming nothing, or a rank above a layer's smaller
    side, is refused naming the flag."""
    layers = projections(model)
    chosen = {n: m for n, m in layers.items() if matches(n, spec.targets)}
    for target in spec.targets:
        if target != "all-linear" and not any(matches(n, (target,)) for n in layers):
            kinds = sorted({n.rsplit(".", 1)[-1] for n in layers})
            raise ConfigError(
                f"--lora-target-modules: {target!r} matches no layer of this model; its projections are "
                f"{', '.join(kinds)} (or all-linear)"
            )
    for name, m in chosen.items():
        if spec.rank > min(m.in_features, m.out_features):
            raise ConfigError(
                f"--lora-rank {spec.rank} is larger than layer {name} ({m.in_features} -> {m.out_features}): "
                f"a rank above {min(m.in_features, m.out_features)} adds nothing; lower it"
            )
    return chosen


def add_low_rank(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted projection."""
    if not module.lora_enabled:
        return out
    x = F.dropout(args[0], module.lora_dropout, module.training) if module.lora_dropout else args[0]
    a, b = module.lora_A, module.lora_B
    return out + F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype) * module.lora_scale


def adapter_shape(layer: nn.Module, which: str, rank: int) -> tuple[int, int]:
    """The shape `lora_A` (r, in) or `lora_B` (out, r) of `layer` must have."""
    return (rank, layer.in_features) if which == "lora_A" else (layer.out_features, rank)


def attach(layer: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float = 0.0) -> None:
    """Give `layer` the adapter (a, b) and the hook that adds it (once); a trainer passes
    parameters, an engine serving beside a quantized base plain tensors."""
    first = not hasattr(layer, "lora_A")
    layer.lora_A, layer.lora_B = a, b
    layer.lora_scale, layer.lora_dropout, layer.lora_enabled = scale, dropout, True
    if first:
        layer.register_forward_hook(add_low_rank)


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Give each target projection a fresh adapter (A Kaiming-uniform from `seed`, B zero) and
    freeze everything else; returns the adapted module names."""
    chosen = target_modules(model, spec)
    model.requires_grad_(False)
    scale = float(torch.tensor(spec.scale))  # the float32 value the engines receive
    gen = torch.Generator().manual_seed(seed)
    for m in chosen.values():
        weight = next(p for p in m.parameters())  # the base's device (quantized codes: a float dtype is used)
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        a = torch.empty(spec.rank, m.in_features)
        bound = 1 / math.sqrt(m.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        a.uniform_(-bound, bound, generator=gen)
        b = torch.zeros(m.out_features, spec.rank)
        attach(
            m,
            nn.Parameter(a.to(weight.device, dtype)),
            nn.Parameter(b.to(weight.device, dtype)),
            scale,
            spec.dropout,
        )
    model.lora_spec = spec
    model.lora_scale_tensor = torch.tensor(scale)  # travels with every sync
    return list(chosen)


def spec_of(model: nn.Module) -> LoraSpec | None:
    """The adapters' spec, or None for a model without adapters."""
    return getattr(model, "lora_spec", None)


def adapted(model: nn.Module) -> dict[str, nn.Module]:
    """Adapted projections by name."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}


def merged_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """W = base + scale * B A of one layer, in one fused call (into `out` when given); trainer
    and engine both merge through here, so they get the same bits."""
    return torch.addmm(base, b.to(base.dtype), a.to(base.dtype), alpha=scale, out=out)


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone (the KL reference of a LoRA run costs no copy of the weights)."""
    layers = list(adapted(model).values())
    for m in layers:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.lora_enabled = True


def merged_state(model: nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base` (HF-named weights) with every adapted layer's weight replaced by W + scale * B A."""
    out, scale = dict(base), float(model.lora_scale_tensor)
    for name, m in adapted(model).items():
        key = f"{name}.weight"
        out[key] = merged_weight(base[key], m.lora_A.detach(), m.lora_B.detach(), scale)
    return out


def merge_and_unload(model: nn.Module) -> nn.Module:
    """In place: each adapter merged into its layer's weight (W + scale * B A) and removed, so
    the model is a plain one again (PEFT's merge_and_unload); plain layers only."""
    with torch.no_grad():
        for m in adapted(model).values():
            m.weight.copy_(merged_weight(m.weight, m.lora_A, m.lora_B, m.lora_scale))
            for hook_id, hook in list(m._forward_hooks.items()):
                if hook is add_low_rank:
                    del m._forward_hooks[hook_id]
            for attr in ("lora_A", "lora_B", "lora_scale", "lora_dropout", "lora_enabled"):
                delattr(m, attr)
    for attr in ("lora_spec", "lora_scale_tensor"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


def trainable_share(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
