"""What a weight sync sends: the policy's HF-named weights, or with LoRA its adapters alone."""

from __future__ import annotations

import torch
import torch.nn as nn

from miles.lora.adapters import spec_of
from miles.lora.serving import SCALE
from miles.models.checkpoint import hf_state_dict, is_adapter_weight


def published_weights(
    model: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """By name, views of the model's tensors (or of `state`, e.g. weights an FSDP model gathered):
    every base weight; with LoRA each adapted layer's `lora_A`, `lora_B` and one `lora.scale`
    (the engines merge W = base + scale * B A, `miles.lora.serving`)."""
    if spec_of(model) is None:
        return hf_state_dict(model, state)
    state = model.state_dict() if state is None else state
    out = {k: v.detach() for k, v in state.items() if is_adapter_weight(k)}
    out[SCALE] = model.lora_scale_tensor
    return out
