"""Policy, value and KL losses on (B, T) response-token tensors with a loss mask.

Every function returns per-token quantities or a scalar reduced with `masked.aggregate`, so the
same aggregation mode applies everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from miles.algo.masked import AggMode, aggregate, masked_mean

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar
    clipfrac: torch.Tensor  # fraction of real tokens whose ratio was clipped
    dual_clipfrac: torch.Tensor  # fraction bounded by the dual clip (negative advantages)
    approx_kl: torch.Tensor  # mean(old_logp - logp): how far the policy moved


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    ratio_type: Literal["token", "sequence"] = "token",
    agg: AggMode = "token-mean",
    norm_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate, -min(r A, clip(r, 1-eps, 1+eps_high) A), per token.

    - eps_clip_high: the upper epsilon (DAPO clip-higher); defaults to eps_clip.
    - eps_clip_c > 1: dual clip, bounds the loss of negative advantages by -eps_clip_c * A.
    - ratio_type="sequence": GSPO's s_i = exp(mean_t(logp - old_logp)) for every token of i.
    - token_weights: detached importance weights (TIS / MIS) multiplying each token's loss.
    - denominator: the global batch's token or sequence count (see `masked.aggregate`).
    """
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c (dual clip) must be > 1, got {eps_clip_c}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = logp - old_logp
    if ratio_type == "sequence":
        seq = masked_mean(log_ratio, mask, dim=-1)  # gradient 1/|y_i| on each token
        log_ratio = seq[:, None].expand_as(logp)
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    surrogate = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(surrogate, clipped)
    is_clipped = clipped > surrogate
    dual = torch.zeros_like(is_clipped)
    if eps_clip_c is not None:
        bound = -advantages * eps_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    if token_weights is not None:
        loss = loss * token_weights.detach()
    m = mask.float()
    return PolicyLoss(
        loss=aggregate(loss, mask, agg, norm_length, denominator),
        clipfrac=masked_mean(is_clipped.float(), m).detach(),
        dual_clipfrac=masked_mean(dual.float(), m).detach(),
        approx_kl=masked_mean(-(logp - old_logp), m).detach(),
    )


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip_high: float,
    agg: AggMode = "token-mean",
    norm_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """CISPO (MiniMax-M1): -sg(min(r, 1 + eps_clip_high)) * A * logp per token, r = exp(logp - old_logp).

    The clipped ratio is a detached weight, so every token keeps its gradient A * w * d logp
    (PPO's clip zeroes the gradient of a clipped token instead). `clipfrac`: tokens whose ratio
    was capped; `dual_clipfrac` is 0 (no dual clip)."""
    log_ratio = (logp - old_logp).detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    capped = ratio > 1.0 + eps_clip_high
    weight = ratio.clamp(max=1.0 + eps_clip_high)
    loss = -advantages * weight * logp
    if token_weights is not None:
        loss = loss * token_weights.detach()
    m = mask.float()
    return PolicyLoss(
        loss=aggregate(loss, mask, agg, norm_length, denominator),
        clipfrac=masked_mean(capped.float(), m),
        dual_clipfrac=torch.zeros(()),
        approx_kl=masked_mean(-log_ratio, m),
    )


def opsm_keep(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2, slime's form): (B, T) weights, 0 where a
    token's advantage is negative and its sequence's mean log(pi_behaviour / pi_theta) over its
    response exceeds `delta` (the policy has moved away from what sampled the sequence; pushing
    such samples further down is what destabilises training), 1 elsewhere. Detached."""
    drift = masked_mean((behaviour_logp - logp).detach(), mask, dim=-1)  # (B,)
    dropped = (advantages.detach() < 0) & (drift[:, None] > delta)
    return (~dropped).float()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = 0.2,
    agg: AggMode = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old, +-value_clip).

    Returns (loss, fraction of tokens where the clipped term was the larger).
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * aggregate(unclipped, mask, agg), torch.zeros(())
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return aggregate(loss, mask, agg), masked_mean((clipped > unclipped).float(), mask).detach()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLType = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, with log r = ref_logp - logp.

    k1 = -log r; k2 = (log r)^2 / 2; k3 = r - 1 - log r (non-negative, low variance);
    low_var_kl = k3 with log r clamped to [-20, 20] and the result to at most 10 (verl's form).
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":  # expm1 keeps tiny |log r| exact; the clamp only removes rounding below 0
        return (torch.expm1(log_r) - log_r).clamp(min=0.0)
    if kind == "low_var_kl":
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.expm1(log_r) - log_r).clamp(0.0, 10.0)
    raise ValueError(f"--kl-loss-type {kind!r} is not one of {KL_TYPES}")
