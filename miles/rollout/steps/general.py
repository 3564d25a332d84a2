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
    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Over the slot range [0, highest slot]: a view of the cache beats gathering rows here.
        Free slots inside the range run dummies at positions 0..T-1 (a new request's prefill
        rewrites them); only the asked rows come back."""
        dev = self.device
        if slots is None:
            return self.model(
                ids.to(dev), positions=positions.to(dev), cache=cache, cache_rows=slice(0, len(ids))
            )
        span, T = int(slots.max()) + 1, ids.shape[1]
        all_ids = torch.zeros(span, T, dtype=torch.long)
        all_positions = torch.arange(T).repeat(span, 1)
        all_ids[slots], all_positions[slots] = ids, positions
        out = self.model(
            all_ids.to(dev), positions=all_positions.to(dev), cache=cache, cache_rows=slice(0, span)
        )
        rows = slots.to(dev)
        return ModelOutput(
            logits=out.logits[rows],
            router_logits=[],
            routed_experts=None if out.routed_experts is None else out.routed_experts[rows],
            hidden=None if out.hidden is None else out.hidden[rows],
        )

    def intact(self) -> bool:
        return True
