"""Ways to move HF-named tensors from the trainer to an engine.

- `bucketed`: pack into `bucket_bytes` buffers, unpack (views) on the other side, verify checksums.
- `one_at_a_time`: each tensor copied and applied alone (the slow baseline OpenRLHF-style
  systems use; kept for the benchmark).
- `shared_memory` (zero-copy, the CPU analogue of CUDA IPC): the trainer's tensors live in shared
  memory; the engine gets handles of a few hundred bytes and maps the same memory.
- `broadcast`: buckets over a weight-update group (gloo on CPU, NCCL on GPU): `miles.sync.group`.

Each `send` returns `SyncStats`; the receiving end is anything with `update_weights(items,
version)` (the rollout engine).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp  # registers the tensor-sharing reductions with ForkingPickler

from miles.models.checkpoint import plan_buckets
from miles.sync.buckets import pack_bucket, unpack_bucket

log = logging.getLogger("miles.sync")


@dataclass
class SyncStats:
    tensors: int = 0
    buckets: int = 0
    payload_bytes: int = 0  # bytes of weights made available to the engine
    moved_bytes: int = 0  # bytes actually serialised or copied through the transport
    seconds: float = 0.0
    changed_fraction: float | None = None  # delta sync: elements that changed since the last version


class BucketBuffer:
    """One staging buffer reused by every bucket of every sync (allocated on first use)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer


def send_bucketed(
    named: Iterable[tuple[str, torch.Tensor]],
    receiver,
    version: int | None,
    bucket_bytes: int,
    verify: bool = True,
    staging: BucketBuffer | None = None,
) -> SyncStats:
    """Pack each bucket (into `staging` when given), hand it over, unpack views, check checksums."""
    stats, t0 = SyncStats(), time.perf_counter()
    for items in plan_buckets(named, bucket_bytes):
        size = sum(t.numel() * t.element_size() + 64 for _, t in items)
        flat, meta = pack_bucket(
            items, checksums=verify, out=staging.get(size) if staging is not None else None
        )
        received = unpack_bucket(flat, meta, verify=verify)
        receiver.update_weights(received, version=version)
        stats.buckets += 1
        stats.tensors += len(items)
        stats.payload_bytes += meta.nbytes
        stats.moved_bytes += meta.nbytes
    stats.seconds = time.perf_counter() - t0
    return stats


def send_one_at_a_time(named: Iterable[tuple[str, torch.Tensor]], receiver, version: int | None) -> SyncStats:
    stats, t0 = SyncStats(), time.perf_counter()
    for name, t in named:
        copy = t.detach().clone()
        receiver.update_weights([(name, copy)], version=version)
        n = t.numel() * t.element_size()
        stats.tensors += 1
        stats.buckets += 1
        stats.payload_bytes += n
        stats.moved_bytes += n
    stats.seconds = time.perf_counter() - t0
    return stats


# ---- zero-copy: shared memory handles ----


def shared_memory_available() -> bool:
    try:
        torch.zeros(1).share_memory_()
        return True
    except (RuntimeError, OSError):
        return False


def share(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Move each tensor's storage into shared memory, in place (parameters stay the same objects)."""
    tmp.set_sharing_strategy("file_system")  # handles are file names: any process on the host can open them
    for _, t in named:
        t.data.share_memory_()


def handles(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """A small picklable description of shared tensors; its size does not grow with their bytes."""
    return bytes(ForkingPickler.dumps([(name, t.detach()) for name, t in named]))


def open_handles(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """Map the trainer's shared tensors in this process (no copy)."""
    return pickle.loads(blob)


def send_shared(named: list[tuple[str, torch.Tensor]], receiver, version: int | None) -> SyncStats:
    """Pass handles to an engine in this process: it maps the memory and copies it into its own
    weights (engine processes get the same handles through `RolloutManager.update_weights_from_handles`)."""
    t0 = time.perf_counter()
    payload = sum(t.numel() * t.element_size() for _, t in named)
    if any(t.is_cuda for _, t in named):
        # same process on a GPU: CUDA cannot open its own IPC handles; the tensors themselves are
        # the zero-copy view
        receiver.update_weights(list(named), version=version)
        return SyncStats(len(named), 1, payload, 0, time.perf_counter() - t0)
    blob = handles(named)
    receiver.update_weights(open_handles(blob), version=version)
    return SyncStats(len(named), 1, payload, len(blob), time.perf_counter() - t0)
