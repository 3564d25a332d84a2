"""A training forward over rows of different lengths, run in length buckets instead of padded to
the longest row.

RL responses differ in length several-fold within a step, so a batch padded to its longest row
spends much of its compute on padding. Here the rows are sorted by length and cut into buckets,
each bucket runs as its own forward padded only to its own longest row, and the outputs are
gathered back into the padded layout, so everything downstream is unchanged. Each row's result
is the one it has in the padded forward up to fp32 rounding (causal attention never looks past a
row's own tokens, and the padding is masked either way).

Where a bucket is cut is chosen by cost: padded token slots plus a fixed price per extra forward
(its Python and kernel-launch overhead, worth many tokens on a tiny model and few on a real one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miles.models.transformer import ModelOutput

# one forward call's fixed cost in FLOPs' worth (Python, launches): about a millisecond a layer
FORWARD_OVERHEAD_FLOPS = 3e9


def overhead_tokens(n_params: int) -> int:
    """A forward call's fixed cost in tokens of this model (2 x params FLOPs a token)."""
    return max(1, int(FORWARD_OVERHEAD_FLOPS / (2 * max(n_params, 1))))


def plan_buckets(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Row indices cut into buckets of similar length (longest first) minimising sum over buckets
    of rows x longest + `overhead` per bucket; cuts fall between distinct lengths (a dynamic
    programme over those, so cheap for any number of rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if not order:
        return []
    # runs of equal length, longest first: a cut only ever falls between two runs
    starts = [0] + [k for k in range(1, len(order)) if lengths[order[k]] != lengths[order[k - 1]]]
    ends = starts[1:] + [len(order)]
    best = [0.0] + [float("inf")] * len(starts)  # best[j]: cost of the first j runs
    cut = [0] * (len(starts) + 1)
    for j in range(1, len(starts) + 1):
        for i in range(j):  # a bucket of runs i..j-1: its longest row is run i's
            cost = best[i] + (ends[j - 1] - starts[i]) * lengths[order[starts[i]]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(starts)
    while j > 0:
        i = cut[j]
        buckets.append(order[starts[i] : ends[j - 1]])
        j = i
    return buckets[::-1]


Call = Callable[[torch.Tensor, int, torch.Tensor | None], ModelOutput]


def bucketed_forward(
    call: Call, lengths: Sequence[int], width: int, head_rows: torch.Tensor | None, overhead: int
) -> ModelOutput:
    """The padded forward's output (rows x `width`) from one `call(rows, length, head_rows)` per
    bucket, which runs those rows cut to `length` columns, with `head_rows` (flat positions of the
    padded layout) restated in that bucket's own layout (flat local_row * length + t). Logits,
    router logits and routed experts come back padded to `width` (zeros past each row's bucket),
    the hidden rows of `head_rows` in its order."""
    buckets = plan_buckets(lengths, overhead)
    bucket_of = torch.empty(len(lengths), dtype=torch.long)  # each row's bucket, and its place in it
    place = torch.empty(len(lengths), dtype=torch.long)
    for k, bucket in enumerate(buckets):
        bucket_of[bucket] = k
        place[bucket] = torch.arange(len(bucket))
    if head_rows is not None:
        device = head_rows.device
        row_of, col = head_rows // width, head_rows % width
        head_bucket, head_place = bucket_of.to(device)[row_of], place.to(device)[row_of]
    outs, head_order = [], []
    slot = torch.full((len(lengths) * width,), -1, dtype=torch.long)  # padded position -> table row
    offset = 0
    for k, bucket in enumerate(buckets):
        length = max(1, max(lengths[r] for r in bucket))
        rows = torch.tensor(bucket, dtype=torch.long)
        slot.view(len(lengths), width)[rows, :length] = (
            offset + torch.arange(len(bucket))[:, None] * length + torch.arange(length)
        )
        offset += len(bucket) * length
        sub_rows = None
        if head_rows is not None:
            picked = (head_bucket == k).nonzero().squeeze(1)
            head_order.append(picked)
            sub_rows = head_place[picked] * length + col[picked]
        outs.append(call(rows, length, sub_rows))
    slot = torch.where(slot < 0, offset, slot)  # padding reads an appended zero row

    def padded(parts: list[torch.Tensor]) -> torch.Tensor:
        table = [p.reshape(-1, *p.shape[2:]) for p in parts]
        table.append(table[0].new_zeros(1, *table[0].shape[1:]))
        index = slot.to(table[0].device)
        return torch.cat(table).index_select(0, index).view(len(lengths), width, *table[0].shape[1:])

    first = outs[0]
    logits = None if first.logits is None else padded([o.logits for o in outs])
    router = [padded([o.router_logits[k] for o in outs]) for k in range(len(first.router_logits))]
    routed = None if first.routed_experts is None else padded([o.routed_experts for o in outs])
    hidden = None if head_rows is None else in_order([o.head_hidden for o in outs], head_order)
    return ModelOutput(logits, router, routed, head_hidden=hidden)


def in_order(parts: list[torch.Tensor], picks: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose entries picks[k][j] are parts[k][j]: per-part results (each part computed
    on the positions it picked) back in the order the positions were asked in."""
    order = torch.cat(picks)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return torch.cat(parts).index_select(0, back.to(parts[0].device))
