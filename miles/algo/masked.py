"""Masked reductions over (B, T) token tensors: the building blocks every loss aggregates with."""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # where() instead of x*mask, so a NaN or inf at a padding position cannot leak in.
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is 1 (0 where the mask is empty)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the masked elements (0 for fewer than two)."""
    n = mask.sum()
    mean = masked_mean(x, mask)
    return masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked tokens; padding stays 0."""
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    norm_length: int | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    - token-mean: sum over all real tokens of the batch / their count (DAPO).
    - seq-mean-token-mean: mean over each sequence's tokens, then over sequences (GRPO paper).
    - seq-mean-token-sum-norm: each sequence's token sum / a constant `norm_length` (default T),
      then mean over sequences (Dr.GRPO: no length bias).

    `denominator`: divide by this count (tokens for token-mean, sequences otherwise) instead of
    this batch's own. Gradient accumulation passes the whole global batch's count
    (see `miles.train.policy_trainer.loss_denominator`, summed over ranks), so the micro-batches' losses add up to
    exactly the global batch's loss, whatever the micro-batch size.
    """
    if mode == "token-mean":
        if denominator is None:
            return masked_mean(token_loss, mask)
        return masked_sum(token_loss, mask) / denominator
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(token_loss, mask, dim=-1)
    elif mode == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else token_loss.shape[-1]
        per_seq = masked_sum(token_loss, mask, dim=-1) / length
    else:
        raise ValueError(f"loss aggregation {mode!r} is not one of {AGG_MODES}")
    return per_seq.mean() if denominator is None else per_seq.sum() / denominator
