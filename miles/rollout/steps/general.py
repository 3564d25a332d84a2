"""The general decode step: the model's own forward over the KV cache (the reference, and the
path for every device and option)."""

from __future__ import annotations

import torch

from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput, Transformer
from miles.models.vision import PromptVision


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
        vision: PromptVision | None = None,
    ) -> ModelOutput:
        dev = self.device
        U, T = ids.shape
        offsets = torch.arange(T).expand(U, T)
        positions = offsets if starts is None else offsets + starts[:, None]
        last = lengths - 1
        images = {}
        if vision is not None:
            images = dict(
                pixel_values=vision.pixel_values.to(dev), image_grid_thw=vision.grid_thw,
                rope_positions=vision.rope_positions.to(dev),
            )  # fmt: skip
        return self.model(
            ids.to(dev),
            positions=positions.to(dev),
            cache=cache,
            cache_rows=slots.to(dev),
            logits_at=last.to(dev),
            token_mask=(offsets <= last[:, None]).to(dev),  # right padding takes no MoE capacity
            **images,
        )

    @torch.no_grad()
    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
        rope_offsets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Over the slot range [0, highest slot]: a view of the cache beats gathering rows here.
        Free slots inside the range run dummies at positions 0..T-1 (a new request's prefill
        rewrites them); only the asked rows come back."""
        dev = self.device
        rope = None if rope_offsets is None else positions + rope_offsets[:, None]
        if slots is None:
            return self.model(
                ids.to(dev), positions=positions.to(dev), cache=cache, cache_rows=slice(0, len(ids)),
                rope_positions=None if rope is None else rope.to(dev),
            )  # fmt: skip
        span, T = int(slots.max()) + 1, ids.shape[1]
        all_ids = torch.zeros(span, T, dtype=torch.long)
        all_positions = torch.arange(T).repeat(span, 1)
        all_ids[slots], all_positions[slots] = ids, positions
        all_rope = None
        if rope is not None:
            all_rope = all_positions.clone()
            all_rope[slots] = rope
            all_rope = all_rope.to(dev)
        out = self.model(
            all_ids.to(dev), positions=all_positions.to(dev), cache=cache, cache_rows=slice(0, span),
            rope_positions=all_rope,
        )  # fmt: skip
        rows = slots.to(dev)
        return ModelOutput(
            logits=out.logits[rows],
            router_logits=[],
            routed_experts=None if out.routed_experts is None else out.routed_experts[rows],
            hidden=None if out.hidden is None else out.hidden[rows],
        )

    def intact(self) -> bool:
        return True
