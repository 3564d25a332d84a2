"""Greedy decoding with a KV cache in one plain loop: the independent oracle the engine and CLI tests compare against."""

from __future__ import annotations

import torch

from miles.models.transformer import Transformer


@torch.no_grad()
def greedy(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None
) -> list[int]:
    """Prefill the prompt, then decode one token at a time; returns the new token ids."""
    stop = set(stop_ids or [])
    cache = model.new_cache(1, len(prompt_ids) + max_new_tokens)
    ids = torch.tensor([prompt_ids])
    positions = torch.arange(len(prompt_ids))[None]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids, positions=positions, cache=cache).logits[:, -1]
        token = int(logits.argmax(-1))
        out.append(token)
        if token in stop:
            break
        ids, positions = torch.tensor([[token]]), positions[:, -1:] + 1
    return out
