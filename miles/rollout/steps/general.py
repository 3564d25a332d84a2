"""The general decode step: the model's own forward over the KV cache (the reference, and the
path for every device and option)."""

from __future__ import annotations

import torch

from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput, Transformer


class GeneralStep:
    name = "general"

    def __init__(self, model: Transformer) -> None:
        self.model, self.device = model, model.lm_head.weight.device

    @torch.no_grad()
    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        starts: torch.Tensor | None = None,
    ) -> ModelOutput:
        dev = self.device
        U, T = ids.shape
        offsets = torch.arange(T).expand(U, T)
        positions = offsets if starts is None else offsets + starts[:, None]
        last = lengths - 1
        return self.model(
            ids.to(dev),
            positions=positions.to(dev),
            cache=cache,
            cache_rows=slots.to(dev),
            logits_at=last.to(dev),
            token_mask=(offsets <= last[:, None]).to(dev),  # right padding takes no MoE capacity
        )

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> ModelOutput:
        dev = self.device
        return self.model(
            ids.to(dev), positions=positions.to(dev), cache=cache, cache_rows=slice(0, len(ids))
        )

    def intact(self) -> bool:
        return True
