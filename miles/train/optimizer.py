"""The AdamW that RL training builds (the policy and the PPO critic)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.Tensor], **options) -> torch.optim.AdamW:
    """torch's AdamW, as its fused kernel wherever that runs (floating-point parameters on CPU or
    CUDA): one pass over each tensor instead of about ten (a third of the optimizer's time)."""
    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused, **options)
