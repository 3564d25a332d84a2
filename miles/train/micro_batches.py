"""How a step's samples are cut into micro-batches, and how a global batch is shared by ranks.

A micro-batch is padded to its longest sample, so its memory is rows x longest, not the sum of
its lengths. `--micro-batch-size` cuts by sample count, in data order; a batch of mixed lengths
then pays for its longest sample in every row. `--use-dynamic-batch-size --max-tokens-per-gpu N`
(slime's flags) sorts the samples by length and fills each micro-batch while rows x longest <= N,
so similar lengths share a micro-batch, little is padded and no micro-batch passes the budget.
The loss of each micro-batch is already divided by the whole global batch's count
(`policy_trainer.loss_denominator`), so any split gives the same gradient.

Across data-parallel ranks every rank takes the same number of samples of each global batch
(the loss scale counts on it), chosen so their token totals are balanced: longest first, each
to the rank with the fewest tokens so far that still has room.
"""

from __future__ import annotations

from collections.abc import Sequence


def fixed_micro_batches(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive runs of `size` (the last may be shorter), in data order."""
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


def token_micro_batches(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """`indices` sorted by length (longest first) and cut so rows x longest <= `budget`; a sample
    longer than the budget goes alone (the run refuses such a budget at start)."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def split_to_count(batches: list[list[int]], count: int) -> list[list[int]]:
    """Halve the largest micro-batches until there are `count` (FSDP and expert parallelism run
    collectives in every forward, so every rank must run the same number)."""
    batches = [list(b) for b in batches]
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[largest]) < 2:
            raise ValueError(f"{len(batches)} single-sample micro-batches cannot become {count}")
        cut = batches.pop(largest)
        batches[largest:largest] = [cut[: len(cut) // 2], cut[len(cut) // 2 :]]
    return batches


def balance_over_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of one global batch for each rank: equal counts (len(lengths) / world each), token
    totals balanced greedily, longest first; each rank's indices in data order."""
    if len(lengths) % world:
        raise ValueError(f"{len(lengths)} samples do not split over {world} ranks")
    room = len(lengths) // world
    shares: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        rank = min((r for r in range(world) if len(shares[r]) < room), key=lambda r: tokens[r])
        shares[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(s) for s in shares]


def rank_shares(lengths: Sequence[int], world: int, step_samples: int, balanced: bool) -> list[list[int]]:
    """Each rank's sample indices for one rollout of training: every optimizer step's global batch
    (`step_samples` consecutive samples) is shared out separately, so rank r's k-th step trains on
    its part of the k-th global batch; token-balanced when `balanced`, else contiguous halves."""
    shares: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, len(lengths), step_samples):
        chunk = list(range(start, min(start + step_samples, len(lengths))))
        if balanced:
            parts = balance_over_ranks([lengths[i] for i in chunk], world)
        else:
            n = len(chunk) // world
            parts = [list(range(r * n, (r + 1) * n)) for r in range(world)]
        for rank, part in enumerate(parts):
            shares[rank] += [chunk[i] for i in part]
    return shares
