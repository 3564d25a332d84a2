"""How an MoE layer picks experts: top-k of the router's softmax, optional expert capacity, and a
batch-invariant mode.

Capacity (Switch/GShard): each expert takes at most C = ceil(N * k / E * factor) of the N real
tokens' slots in one forward; the rest are dropped (the slot adds nothing and the residual
stream carries the token). Policy `probs` keeps each expert's C highest-probability slots,
`position` its first C in token order. A dropped slot is recorded as -(expert + 2), so routing
records (and routing replay) carry the drop: -1 stays "no record", >= 0 a kept expert.

Deterministic routing: the router's matmul runs on fixed tiles of rows (a row's result then
does not depend on how many rows share the call: CPU GEMMs pick their blocking by shape) and
ties go to the lower expert index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NO_RECORD = -1
DROP_POLICIES = ("probs", "position")
TILE_ROWS = 64  # rows per GEMM call in batch-invariant mode


@dataclass
class RoutingOptions:
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"
    deterministic: bool = False


def encode_dropped(experts: torch.Tensor) -> torch.Tensor:
    """The record of dropped slots: -(expert + 2), never -1 (no record) or a kept id."""
    return -(experts + 2)


def decode_experts(record: torch.Tensor) -> torch.Tensor:
    """Expert ids of a routing record whether the slot was kept or dropped (-1 stays -1)."""
    return torch.where(record <= -2, -(record + 2), record)


def dropped(record: torch.Tensor) -> torch.Tensor:
    return record <= -2


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Slots one expert may take in a forward of `n_tokens` real tokens."""
    return math.ceil(n_tokens * top_k / n_experts * factor)


def tiled_apply(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over the rows of x, TILE_ROWS at a time, the last tile zero-padded.

    Not only GEMMs depend on their batch: a CPU elementwise kernel (silu, sigmoid, mul) splits a
    long tensor over threads and finishes each part's odd end with a scalar tail, so the same
    value can round differently at another position. Full tiles give every call one length."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    n = rows.shape[0]
    pad = (-n) % TILE_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([fn(tile) for tile in rows.split(TILE_ROWS)])[:n]
    return out.reshape(*shape[:-1], out.shape[-1])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on full TILE_ROWS-row tiles: every GEMM call has the same shape, so each row's
    result is bitwise independent of the other rows (CPU GEMMs pick their blocking by shape)."""
    return tiled_apply(lambda tile: F.linear(tile, weight, bias), x)


def top_k(probs: torch.Tensor, k: int, deterministic: bool) -> torch.Tensor:
    """Expert ids (N, k), highest probability first; with `deterministic` ties go to the lower index."""
    if deterministic:
        return probs.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return probs.topk(k, dim=-1).indices


def keep_within_capacity(
    experts: torch.Tensor,  # (N, K) chosen experts
    scores: torch.Tensor,  # (N, K) their router probabilities
    valid: torch.Tensor | None,  # (N,) real tokens; padding neither counts nor is kept
    n_experts: int,
    factor: float,
    policy: str,
) -> torch.Tensor:
    """(N, K) bool: which slots fit in their expert's capacity under `policy`."""
    N, K = experts.shape
    if valid is None:
        valid = torch.ones(N, dtype=torch.bool, device=experts.device)
    cap = capacity(int(valid.sum()), K, n_experts, factor)
    flat = experts.reshape(-1)
    slot_valid = valid[:, None].expand(N, K).reshape(-1)
    bucket = torch.where(slot_valid, flat, torch.full_like(flat, n_experts))  # padding: a bucket of its own
    if policy == "probs":  # by expert, then highest probability first (ties: earlier slot)
        order = scores.reshape(-1).float().argsort(descending=True, stable=True)
        order = order[bucket[order].argsort(stable=True)]
    elif policy == "position":  # by expert, then token order
        order = bucket.argsort(stable=True)
    else:
        raise ValueError(f"drop policy {policy!r}: expected one of {DROP_POLICIES}")
    counts = torch.bincount(bucket, minlength=n_experts + 1)
    starts = counts.cumsum(0) - counts
    sorted_bucket = bucket[order]
    rank = torch.arange(len(order), device=flat.device) - starts[sorted_bucket]
    keep = torch.zeros_like(slot_valid)
    keep[order] = (rank < cap) & (sorted_bucket < n_experts)
    return keep.view(N, K)


def invariant_attention(
    q: torch.Tensor,  # (B, H, T, D)
    k: torch.Tensor,  # (B, KV, S, D)
    v: torch.Tensor,  # (B, KV, S, D)
    mask: torch.Tensor,  # (B, 1, T, S) bool, True = may attend
    tile: int = TILE_ROWS,
) -> torch.Tensor:
    """Softmax attention whose result for a query row depends only on that row's own keys.

    Online softmax over fixed (tile x tile) blocks: every GEMM has the same shape whatever the
    batch's length, and a block of keys the row may not see adds exact zeros (its maximum stays,
    the rescale factor is exp(0) = 1), so padding and batch-mates change nothing bitwise."""
    B, H, T, D = q.shape
    S, groups = k.shape[2], H // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pad_t, pad_s = (-T) % tile, (-S) % tile
    q = F.pad(q, (0, 0, 0, pad_t))
    k, v = F.pad(k, (0, 0, 0, pad_s)), F.pad(v, (0, 0, 0, pad_s))
    mask = F.pad(mask, (0, pad_s, 0, pad_t), value=False)
    scale = D**-0.5
    outs = []
    for t0 in range(0, T + pad_t, tile):
        qt = q[:, :, t0 : t0 + tile] * scale
        best = q.new_full((B, H, tile, 1), float("-inf"))
        total = q.new_zeros(B, H, tile, 1)
        acc = q.new_zeros(B, H, tile, D)
        for s0 in range(0, S + pad_s, tile):
            seen = mask[:, :, t0 : t0 + tile, s0 : s0 + tile]
            if not seen.any():
                continue  # nothing visible in this block for any row: skipping it is exact
            scores = torch.matmul(qt, k[:, :, s0 : s0 + tile].transpose(-1, -2)).masked_fill(
                ~seen, float("-inf")
            )
            new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
            shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
            p = torch.exp(scores - shift)
            rescale = torch.exp(
                torch.where(torch.isinf(best), torch.full_like(best, float("-inf")), best - shift)
            )
            total = total * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p, v[:, :, s0 : s0 + tile])
            best = new_best
        outs.append(acc / total.clamp(min=torch.finfo(total.dtype).tiny))
    return torch.cat(outs, dim=2)[:, :, :T]


class BatchInvariantLinear(torch.nn.Linear):
    """nn.Linear on fixed row tiles (`tiled_linear`): same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias)


def apply_routing(model: torch.nn.Module, options: RoutingOptions) -> int:
    """Set every MoE layer's routing; with `deterministic` the whole model becomes batch-invariant
    (fixed-tile GEMMs for full-precision projections, blocked attention), so routing and log-probs
    of a sequence are bitwise the same alone, in any batch and under any padding. Returns the
    number of MoE layers."""
    layers = 0
    for module in model.modules():
        if hasattr(module, "routing"):
            module.routing = RoutingOptions(
                options.capacity_factor, options.drop_policy, options.deterministic
            )
            layers += 1
        if options.deterministic:
            if type(module) is torch.nn.Linear:
                module.__class__ = BatchInvariantLinear
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = True
    return layers


def routing_options(cfg) -> RoutingOptions:
    """The run's routing settings (trainer and engines use the same ones)."""
    return RoutingOptions(
        cfg.train.moe_capacity_factor, cfg.train.moe_token_drop_policy, cfg.algo.deterministic_expert_routing
    )
