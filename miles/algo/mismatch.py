"""Train/inference mismatch: importance-sampling corrections (TIS, MIS/icepop) and metrics.

The rollout engine's log-probabilities (pi_rollout) differ slightly from the trainer's
(pi_old, recomputed before the update). Samples come from pi_rollout but the PPO loss assumes
pi_old, so each token's loss is reweighted by w = pi_old / pi_rollout, bounded:

- truncate (TIS): w = clamp(ratio, clip_low, clip_high)
- mask (MIS / icepop): w = ratio inside [clip_low, clip_high], 0 outside
- threshold (--tis-threshold t in (0, 1]): a trust band [t, 1/t]; a token (or
  sequence) whose ratio falls outside it is masked (w = 0), the rest are truncated at clip_high.

level: "token" (ratio per token), "sequence" (exp of the summed log ratio, one per sample),
"geometric" (exp of the mean log ratio). Weights are detached: they rescale, never train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from miles.algo.masked import masked_mean, masked_sum
from miles.models.routing import NO_RECORD, decode_experts

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "mask"]


@dataclass
class ISWeights:
    weights: torch.Tensor  # (B, T), detached, 0 on padding
    mean: torch.Tensor  # mean weight over real tokens
    clipfrac: torch.Tensor  # fraction of real tokens truncated or masked


def importance_weights(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: Level = "token",
    mode: Mode = "truncate",
    clip_high: float = 2.0,
    clip_low: float = 0.0,
    threshold: float | None = None,
) -> ISWeights:
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"--tis-threshold must be in (0, 1], got {threshold}")
    if clip_low > clip_high:
        raise ValueError(f"--tis-clip-low {clip_low} is above --tis-clip {clip_high}")
    m = mask.bool()
    delta = torch.where(m, (train_logp - rollout_logp).detach().float(), torch.zeros(()))
    if level == "token":
        log_ratio = delta
    elif level == "sequence":
        log_ratio = masked_sum(delta, m, dim=-1)[:, None].expand_as(delta)
    elif level == "geometric":
        log_ratio = masked_mean(delta, m, dim=-1)[:, None].expand_as(delta)
    else:
        raise ValueError(f"importance-sampling level {level!r} is not token, sequence or geometric")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    if mode == "truncate":
        weights = ratio.clamp(clip_low, clip_high)
        changed = (ratio > clip_high) | (ratio < clip_low)
    elif mode == "mask":
        inside = (ratio >= clip_low) & (ratio <= clip_high)
        weights = torch.where(inside, ratio, torch.zeros_like(ratio))
        changed = ~inside
    else:
        raise ValueError(f"importance-sampling mode {mode!r} is not truncate or mask")
    if threshold is not None:
        outside = (ratio < threshold) | (ratio > 1.0 / threshold)
        weights = torch.where(outside, torch.zeros_like(weights), weights)
        changed = changed | outside
    weights = torch.where(m, weights, torch.zeros_like(weights))
    return ISWeights(weights=weights, mean=masked_mean(weights, m), clipfrac=masked_mean(changed.float(), m))


def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs are from the engine's, over real response tokens.

    train_rollout_logprob_abs_diff is slime's watched metric (<= 0.1 normal, < 1e-6 for
    deterministic runs). KL(rollout || train) is estimated from the rollout's own samples with k1
    (mean log pi_r - log pi_t) and k3 (r - 1 - log r, r = pi_t / pi_r).
    """
    m = mask.bool()
    diff = (train_logp - rollout_logp).detach().float()
    abs_diff = diff.abs()
    any_token = bool(m.any())
    return {
        "train_rollout_logprob_abs_diff": float(masked_mean(abs_diff, m)),
        "train_rollout_logprob_abs_diff_max": float(abs_diff[m].max()) if any_token else 0.0,
        "kl_rollout_train_k1": float(masked_mean(-diff, m)),
        "kl_rollout_train_k3": float(masked_mean(torch.expm1(diff.clamp(-20, 20)) - diff.clamp(-20, 20), m)),
    }


def routing_mismatch(
    router_logits: torch.Tensor, recorded: torch.Tensor, weight: torch.Tensor
) -> dict[str, float]:
    """How often the trainer's own top-k experts differ from those the rollout engine used.

    `router_logits`: (B, T, layers, E), every MoE layer's; `recorded`: (B, T, layers, K) expert
    ids from the rollout (-(e + 2) for a slot dropped over capacity), -1 where none was recorded;
    `weight`: (B, T) how many times each position counts (a mask: 0 or 1). A decision is one
    (token, layer) top-k set (order ignored). Returns the fraction of decisions that differ and
    the fraction of tokens with at least one differing layer ("different experts activated
    during train vs inference"; R3 replays the recorded ones instead).
    """
    k = recorded.shape[-1]
    rec = recorded.to(router_logits.device)
    valid = (weight > 0) & (rec != NO_RECORD).all(-1).all(-1)
    if not valid.any():
        return {}
    own = router_logits[valid].detach().topk(k, dim=-1).indices.sort(-1).values  # (N, layers, K)
    # a slot dropped over capacity still names the expert chosen
    differ = (own != decode_experts(rec[valid]).sort(-1).values).any(-1)  # (N, layers)
    times = weight[valid].double()
    return {
        "routing_mismatch_frac": float((differ.double().mean(-1) * times).sum() / times.sum()),
        "routing_mismatch_token_frac": float((differ.any(-1).double() * times).sum() / times.sum()),
    }
