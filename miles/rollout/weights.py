"""Loading Hugging Face-named tensors into a live model (the receiving end of weight sync)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles.errors import MilesError
from miles.lora.serving import apply_adapter_update, is_adapter_update, served_adapter
from miles.models.transformer import Transformer


def apply_named_tensors(model: Transformer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (HF name, tensor) into `model`; all are checked before any is copied.

    Returns the number of tensors applied. A tied lm_head.weight is accepted and skipped. LoRA
    adapters (`<module>.lora_A/B`, `lora.scale`) are merged into their layers (`miles.lora.serving`).
    """
    named_tensors = list(named_tensors)
    adapters = [(n, t) for n, t in named_tensors if is_adapter_update(n)]
    if adapters:
        named_tensors = [(n, t) for n, t in named_tensors if not is_adapter_update(n)]
        applied = apply_adapter_update(model, adapters)
        return applied + (apply_named_tensors(model, named_tensors) if named_tensors else 0)
    params = dict(model.state_dict(keep_vars=True))
    # layers that store weights their own way (FP8 codes, packed INT4) load them through load_weight
    loaders = {f"{n}.weight": m for n, m in model.named_modules() if hasattr(m, "load_weight")}
    tied = model.config.tie_word_embeddings
    todo = []
    for name, tensor in named_tensors:
        if name == "lm_head.weight" and tied:
            continue
        if name not in params:
            raise MilesError(
                f"weight update: {name!r} is not a parameter of this {model.config.model_type} model"
            )
        loader = loaders.get(name)  # packed INT4 is stored in another shape: compare the layer's own
        shape = (loader.out_features, loader.in_features) if loader is not None else tuple(params[name].shape)
        if tuple(tensor.shape) != shape:
            raise MilesError(
                f"weight update: {name!r} has shape {tuple(tensor.shape)}, the model's is {shape}"
            )
        todo.append((name, params[name], tensor))
    if todo and served_adapter(model).base:  # whole weights replace the base an adapter was merged onto
        model.served_lora = None
    with torch.no_grad():
        for name, param, tensor in todo:
            if name in loaders:
                loaders[name].load_weight(tensor)
            else:
                param.copy_(tensor)
    return len(todo)


def served_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights and, when it serves a LoRA adapter, the adapter tensors as received."""
    return {**model.state_dict(), **served_adapter(model).served}
