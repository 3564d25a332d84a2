"""MoE load statistics and the load-balancing loss, from one forward's routing.

The loss is Megatron's (Switch Transformer's): per MoE layer E * sum_i f_i * P_i, with f_i the
share of routed (token, slot) pairs that chose expert i (count_i / (T * top_k)) and P_i the mean
router probability of expert i over the T tokens; averaged over layers and scaled by
--aux-loss-coef. It is 1 for uniform routing and up to E / top_k when every token picks the same
experts. Hugging Face's Qwen-MoE loss does not divide by top_k (it is top_k times this one) and
pools the layers' tokens before the product.

The load metrics are what a user watches for a collapsed router: the busiest expert's load over
the mean load (pooled over layers by expert index, and per layer: a layer's own imbalance can hide
in the pool when layers favour different experts), the busiest expert's slots over the balanced
share (what a capacity factor bounds), the share of experts that got no token, the router's
entropy and the share of slots dropped over capacity.
"""

from __future__ import annotations

import torch

from miles.models.routing import decode_experts, dropped

MAX_EXPERTS_LISTED = 64  # per-expert shares are logged up to this many experts


def routing_counts(
    record: torch.Tensor, weight: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, kept) slot counts per layer and expert, each (L, E) float64, over the tokens of a
    routing record (B, T, L, K), each counted `weight` (B, T) times (the attention mask: once
    each real token; a packed group's prompt row: once for each sample it stands for): `chosen`
    counts every slot's expert (before capacity), `kept` only the slots that were not dropped."""
    counted = weight > 0
    rec = record[counted]  # (N, L, K)
    _, L, K = rec.shape
    times = weight[counted].double().repeat_interleave(L * K)
    experts = decode_experts(rec).clamp(min=0)
    layer = torch.arange(L, device=rec.device)[None, :, None].expand_as(rec)
    flat = (layer * n_experts + experts).reshape(-1)
    chosen = torch.bincount(flat, times, minlength=L * n_experts).view(L, n_experts)
    not_dropped = ~dropped(rec).reshape(-1)
    kept = torch.bincount(flat[not_dropped], times[not_dropped], minlength=L * n_experts)
    return chosen.cpu(), kept.view(L, n_experts).cpu()


def load_balancing_loss(
    router_logits: list[torch.Tensor], weight: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """E * sum_i f_i * P_i per layer, averaged over layers; f from `chosen` (L, E) counts (this
    forward's, or pooled over the step for the global variant), P from these router logits, a
    mean over the tokens, each counted `weight` (B, T) times (see `routing_counts`)."""
    counted = weight > 0
    times = weight[counted].float()[:, None]
    f = chosen / chosen.sum(-1, keepdim=True).clamp(min=1)
    losses = []
    for layer, logits in enumerate(router_logits):
        probs = logits.float().softmax(-1)[counted]  # (N, E)
        E = probs.shape[-1]
        mean = (probs * times).sum(0) / times.sum()
        losses.append(E * (f[layer].to(probs) * mean).sum())
    return torch.stack(losses).mean()


def router_entropy_sum(router_logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per layer, the sum over tokens (each counted `weight` (B, T) times) of the router
    distribution's entropy (nats), (L,) float64; `router_logits` (B, T, L, E), every MoE layer's
    at once (one pass, not one a layer)."""
    counted = weight > 0
    logp = router_logits[counted].detach().float().log_softmax(-1)  # (N, L, E)
    per_token = -(logp.exp() * logp).sum(-1)  # (N, L)
    return (per_token.double() * weight[counted].double()[:, None]).sum(0).cpu()


class LoadAccumulator:
    """Counts summed over the micro-batches (and, by the caller, the ranks) of one training call."""

    def __init__(self) -> None:
        self.chosen = self.kept = self.entropy = None
        self.tokens = 0.0

    def add(self, chosen: torch.Tensor, kept: torch.Tensor, entropy: torch.Tensor, tokens: float) -> None:
        if self.chosen is None:
            self.chosen, self.kept, self.entropy = chosen.clone(), kept.clone(), entropy.clone()
        else:
            self.chosen += chosen
            self.kept += kept
            self.entropy += entropy
        self.tokens += tokens

    def flat(self) -> list[float]:
        """Everything as one list (for one all-reduce over ranks)."""
        return [
            *self.chosen.reshape(-1).tolist(),
            *self.kept.reshape(-1).tolist(),
            *self.entropy.tolist(),
            self.tokens,
        ]

    def metrics(self, summed: list[float] | None = None) -> dict[str, float]:
        """The load metrics; `summed`: `flat()` after summing over ranks."""
        if self.chosen is None:
            return {}
        L, E = self.chosen.shape
        values = torch.tensor(summed if summed is not None else self.flat(), dtype=torch.float64)
        chosen = values[: L * E].view(L, E)
        kept = values[L * E : 2 * L * E].view(L, E)
        entropy, tokens = values[2 * L * E : 2 * L * E + L], float(values[-1])
        return load_metrics(chosen, kept, entropy, tokens)


def load_metrics(
    chosen: torch.Tensor, kept: torch.Tensor, entropy: torch.Tensor, tokens: float
) -> dict[str, float]:
    """Load metrics from (L, E) slot counts and per-layer entropy sums over `tokens` tokens."""
    L, E = kept.shape
    ratio = kept.max(-1).values / kept.mean(-1).clamp(min=1e-9)  # (L,)
    # the busiest expert's kept slots over the balanced share (every chosen slot spread evenly):
    # capacity factor F bounds this near F, whatever the router prefers
    balanced = kept.max(-1).values / (chosen.sum(-1) / E).clamp(min=1e-9)
    pooled = kept.sum(0)  # expert index e summed over layers
    out = {
        "expert_load_max_over_mean": float(pooled.max() / pooled.mean().clamp(min=1e-9)),
        "expert_layer_load_max_over_mean": float(ratio.mean()),
        "expert_load_max_over_balanced": float(balanced.mean()),
        "expert_idle_frac": float((kept == 0).double().mean()),
        "router_entropy": float(entropy.sum() / max(tokens * L, 1.0)),
        "expert_dropped_frac": float(1 - kept.sum() / chosen.sum().clamp(min=1)),
    }
    out.update({f"expert_load_max_over_mean_l{i}": float(r) for i, r in enumerate(ratio)})
    if E <= MAX_EXPERTS_LISTED:
        share = kept.sum(0) / kept.sum().clamp(min=1)
        out.update({f"expert_share_e{e}": float(s) for e, s in enumerate(share)})
    return out
