"""The trainer's model as a run configures it: quantized layers and routing, then expert offload."""

from __future__ import annotations

import torch.nn as nn

from miles.quant.convert import quantize_train_model
from miles.train.expert_offload import offload_experts


def prepare_train_model(model: nn.Module, cfg) -> nn.Module:
    """In place: FP8/INT4 layers and routing options (`quantize_train_model`), activation
    recomputation, then, with --offload-experts, expert weights in host memory."""
    quantize_train_model(model, cfg)
    model.recompute_activations = cfg.train.recompute_activations
    if cfg.train.offload_experts:
        offload_experts(model)
    return model
