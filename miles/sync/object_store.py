"""Weights through Ray's object store: buckets put once by the sender, read in place by every engine."""

from __future__ import annotations

from collections.abc import Iterable

import ray
import torch

from miles.models.checkpoint import plan_buckets
from miles.sync.buckets import BucketMeta, pack_bucket


def from_object_store(array) -> torch.Tensor:
    """A tensor from what Ray's object store gave back: numpy arrays come back as read-only views
    of the shared store (no copy, unlike a pickled tensor: ~3x faster end to end); we only read
    them. A tensor (dtypes numpy lacks, e.g. bfloat16, travel pickled) passes through."""
    import warnings

    if isinstance(array, torch.Tensor):
        return array
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": it is never written
        return torch.from_numpy(array)


def put_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[tuple[BucketMeta, ray.ObjectRef]]:
    """Checksummed buckets put into Ray's object store by this process (as numpy: engines read
    them in place), with their metadata."""
    out = []
    for items in plan_buckets(named, bucket_bytes):
        flat, meta = pack_bucket(items)
        out.append((meta, ray.put(flat.numpy())))
    return out
