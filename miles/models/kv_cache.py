"""A key/value cache allocated once: `slots` sequences of up to `max_len` positions per layer.

Each slot is filled independently (a slot can be reused by a new request while others decode),
so writes and reads take the slot rows and each token's own position.
"""

from __future__ import annotations

import torch

Rows = slice | torch.Tensor


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
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.slots, self.max_len = slots, max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

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
