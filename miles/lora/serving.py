"""The engine's side of a LoRA run: it receives adapters only and serves base + adapter merged.

A sync carries each adapted layer's `<module>.lora_A` (r, in) and `<module>.lora_B` (out, r) and
one `lora.scale`; the engine keeps a copy of each adapted layer's base weight (taken when the
first adapter arrives) and writes W = base + scale * B A into its own layer, so its decode step,
fused or general, runs a plain model at full speed. The received tensors are kept as they came
(`served`): `--check-lora-weight-equal` reads them back. A and B may arrive in different
buckets: a layer is merged once it has both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from miles.errors import MilesError
from miles.lora.adapters import adapter_shape, attach, merged_weight
from miles.models.checkpoint import is_adapter_weight

SCALE = "lora.scale"


def is_adapter_update(name: str) -> bool:
    return name == SCALE or is_adapter_weight(name)


class ServedAdapter:
    """An engine model's base copies and the adapter it serves (kept on the model object)."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.served: dict[str, torch.Tensor] = {}


def served_adapter(model: nn.Module) -> ServedAdapter:
    state = getattr(model, "served_lora", None)
    if state is None:
        state = model.served_lora = ServedAdapter()
    return state


def apply_adapter_update(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Take adapter tensors (any subset of a sync) and re-merge every layer they complete."""
    named = list(named)
    state = served_adapter(model)
    modules = dict(model.named_modules())
    touched, count = set(), 0
    for name, t in named:
        if name != SCALE:
            module_name = name.rsplit(".", 1)[0]
            layer = modules.get(module_name)
            if layer is None or not hasattr(layer, "in_features"):
                raise MilesError(f"LoRA update: {name!r} names no projection of this model")
            which = name.rsplit(".", 1)[1]
            want = adapter_shape(layer, which, t.shape[0] if which == "lora_A" else t.shape[-1])
            if t.dim() != 2 or tuple(t.shape) != want:
                raise MilesError(f"LoRA update: {name!r} has shape {tuple(t.shape)}, the layer needs {want}")
            touched.add(module_name)
        state.served[name] = t.detach().clone()
        count += 1
    if SCALE not in state.served:
        return count  # the scale comes in a later bucket: merge then
    scale = float(state.served[SCALE])
    if any(n == SCALE for n, _ in named):  # the scale itself arrived: every layer held so far
        touched = {n.rsplit(".", 1)[0] for n in state.served if n != SCALE}
    with torch.no_grad():
        for module_name in sorted(touched):
            a, b = state.served.get(f"{module_name}.lora_A"), state.served.get(f"{module_name}.lora_B")
            if a is None or b is None:
                continue
            layer = modules[module_name]
            if hasattr(layer, "load_weight"):
                # FP8/INT4: the adapter beside the quantized base through the trainer's own hook;
                # requantizing W + BA would add a rounding the trainer (QLoRA) never sees
                device = next(iter([*layer.parameters(), *layer.buffers()])).device  # codes are buffers
                attach(layer, a.to(device, torch.float32), b.to(device, torch.float32), scale)
                continue
            base = state.base.get(module_name)
            if base is None:
                base = state.base[module_name] = layer.weight.detach().clone()
            merged_weight(
                base, a.to(base.device), b.to(base.device), scale, out=layer.weight
            )  # bumps its version: the fused step repacks
    return count
