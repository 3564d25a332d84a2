"""The key/value cache: `slots` sequences of up to `max_len` positions per layer, whose memory
follows the tokens in flight.

Each slot is filled independently (a slot can be reused by a new request while others decode),
so writes and reads take the slot rows and each token's own position. On CPU each layer's keys
and values live in an anonymous memory mapping the OS fills on first touch: a slot holding L
tokens makes L positions of it resident (a page holds 4096 / (head_dim x 4) positions of one
head), untouched positions read as zeros and cost nothing, and `release(slot)` hands a finished
request's pages back. So an engine with 64 slots of an 8192-token context costs what its
requests hold, not the 64 x 8192 worst case. On a GPU the cache is allocated whole.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import torch

Rows = slice | torch.Tensor
PAGE = mmap.PAGESIZE
# no swap space is set aside for it (Python's mmap module names the flag from 3.13 on)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _paged_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero tensor of `shape` over an anonymous mapping: no memory is taken until written."""
    count = 1
    for n in shape:
        count *= n
    size = max(count * torch.empty((), dtype=dtype).element_size(), 1)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    area = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(area, dtype=dtype, count=count).view(shape), area


class KVCache:
    """Keys and values laid out (slots, kv_heads, max_len, head_dim), one pair per layer."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        self.paged = torch.device(device).type == "cpu"
        self.areas: list[mmap.mmap] = []  # the mappings under the tensors (CPU)
        if self.paged:
            pairs = [_paged_zeros(shape, dtype) for _ in range(2 * num_layers)]
            self.areas = [area for _, area in pairs]
            tensors = [t for t, _ in pairs]
        else:
            tensors = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2 * num_layers)]
        self.keys, self.values = tensors[:num_layers], tensors[num_layers:]
        self.slots, self.max_len = slots, max_len
        self.slot_bytes = kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = (
            2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def nbytes(self) -> int:
        """The cache's full size (on CPU, address space: what is resident follows use)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def resident_bytes(self) -> int:
        """The memory the cache holds now: its pages present and its own (Linux's pagemap: a read
        of a never-written position maps the kernel's shared zero page, which holds nothing); on
        a GPU, its size."""
        if not self.paged:
            return self.nbytes
        pages = 0
        with open("/proc/self/pagemap", "rb") as pagemap:
            for t in self.keys + self.values:
                first, count = t.data_ptr() // PAGE, -(-t.numel() * t.element_size() // PAGE)
                pagemap.seek(first * 8)
                entries = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
                pages += int(np.count_nonzero((entries >> 63) & (entries >> 56) & 1))
        return pages * PAGE

    def release(self, slot: int) -> None:
        """Hand slot `slot`'s memory back (its request finished); it reads as zeros after. The
        pages a neighbouring slot shares at the edges stay."""
        if not self.paged:
            return
        start, end = slot * self.slot_bytes, (slot + 1) * self.slot_bytes
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages inside the slot
        if last > first:
            for area in self.areas:
                area.madvise(mmap.MADV_DONTNEED, first, last - first)

    def clear(self) -> None:
        """Every slot reads as zeros again, and holds no memory (on CPU)."""
        if self.paged:
            for area in self.areas:
                area.madvise(mmap.MADV_DONTNEED)
        else:
            for t in self.keys + self.values:
                t.zero_()

    def write(
        self, layer: int, rows: Rows, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v (B, kv_heads, T, head_dim) of rows `rows` at `positions` (B, T).

        Positions within a row must be distinct (pad tokens get positions past the real ones).
        """
        if int(positions.max()) >= self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; position {int(positions.max())} asked"
            )
        row_ids = torch.arange(self.slots, device=positions.device)[rows] if isinstance(rows, slice) else rows
        index = (row_ids[:, None], slice(None), positions)
        self.keys[layer][index] = k.transpose(1, 2)
        self.values[layer][index] = v.transpose(1, 2)

    def read(self, layer: int, rows: Rows, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) for `rows` (a view when rows is a slice)."""
        return self.keys[layer][rows, :, :length], self.values[layer][rows, :, :length]
