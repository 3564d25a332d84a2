"""The trainer's model as a run configures it: quantized layers and routing, LoRA adapters, then
expert offload."""

from __future__ import annotations

import logging

import torch.nn as nn

from miles.errors import ConfigError
from miles.lora.adapters import LoraSpec, add_adapters, parse_targets, trainable_share
from miles.lora.peft_files import load_adapter
from miles.quant.convert import quantize_train_model
from miles.train.expert_offload import offload_experts

log = logging.getLogger("miles")


def add_lora(model: nn.Module, cfg) -> None:
    """--lora-rank / --lora-adapter-path: adapters on the target layers, the base frozen. With an
    adapter file its rank, alpha and layers are used; an explicit different --lora-rank is refused."""
    lc = cfg.lora
    if lc.lora_adapter_path is not None:
        spec = load_adapter(model, lc.lora_adapter_path, seed=cfg.train.seed)
        if lc.lora_rank and lc.lora_rank != spec.rank:
            raise ConfigError(
                f"--lora-rank {lc.lora_rank} differs from the rank {spec.rank} of --lora-adapter-path "
                f"{lc.lora_adapter_path}; drop --lora-rank (the adapter's own is used)"
            )
    else:
        alpha = lc.lora_alpha if lc.lora_alpha is not None else 2.0 * lc.lora_rank
        add_adapters(
            model,
            LoraSpec(lc.lora_rank, alpha, lc.lora_dropout, parse_targets(lc.lora_target_modules)),
            cfg.train.seed,
        )
    trainable, total = trainable_share(model)
    log.info("LoRA: %d trainable parameters of %d (%.2f%%)", trainable, total, 100 * trainable / total)


def prepare_train_model(model: nn.Module, cfg) -> nn.Module:
    """In place: FP8/INT4 layers and routing options (`quantize_train_model`), LoRA adapters,
    activation recomputation, then, with --offload-experts, expert weights in host memory."""
    quantize_train_model(model, cfg)
    if cfg.lora.enabled:
        add_lora(model, cfg)
    model.recompute_activations = cfg.train.recompute_activations
    if cfg.train.offload_experts:
        offload_experts(model)
    return model
