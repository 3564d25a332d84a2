"""Weight-sync buckets: many HF-named tensors flattened into one byte buffer, with checksums.

A bucket is at most `bucket_bytes` (one tensor larger than that gets a bucket of its own). The
receiver unpacks views into the buffer (no copy) and checks every tensor's CRC32, so a corrupted
transfer is caught and the tensors it hit are named.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles.errors import MilesError


class SyncIntegrityError(MilesError):
    """Weights arrived different from what the trainer sent."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class BucketMeta:
    tensors: tuple[TensorMeta, ...]
    nbytes: int


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (CPU)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t).cpu().numpy())


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split tensors, in order, into groups of at most `bucket_bytes` bytes each."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    return [b for b in buckets if b]


ALIGN = 64  # every tensor starts on a 64-byte boundary, so views of any dtype are legal


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(
    items: list[tuple[str, torch.Tensor]], checksums: bool = True, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, BucketMeta]:
    """Copy tensors into one uint8 buffer (`out` when it is large enough: reusing a buffer saves
    the page faults of a fresh allocation); the metadata says where each one lies."""
    offsets, total = [], 0
    for _, t in items:
        offsets.append(total)
        total = _aligned(total + t.numel() * t.element_size())
    flat = out[:total] if out is not None and out.numel() >= total else torch.empty(total, dtype=torch.uint8)
    metas = []
    for (name, t), offset in zip(items, offsets):
        raw = tensor_bytes(t)
        flat[offset : offset + raw.numel()] = raw
        metas.append(
            TensorMeta(name, tuple(t.shape), t.dtype, offset, raw.numel(), crc32(t) if checksums else -1)
        )
    return flat, BucketMeta(tuple(metas), total)


def unpack(flat: torch.Tensor, meta: BucketMeta, verify: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor in `flat`; with `verify`, raise naming every tensor whose CRC differs."""
    if flat.numel() != meta.nbytes:
        raise SyncIntegrityError(f"bucket has {flat.numel()} bytes, expected {meta.nbytes}")
    out, bad = [], []
    for m in meta.tensors:
        raw = flat[m.offset : m.offset + m.nbytes]
        if verify and m.crc32 >= 0 and zlib.crc32(raw.numpy()) != m.crc32:
            bad.append(m.name)
        out.append((m.name, raw.view(m.dtype).view(m.shape)))
    if bad:
        raise SyncIntegrityError(f"weight sync: {len(bad)} tensor(s) arrived corrupted: {bad[:5]}")
    return out
