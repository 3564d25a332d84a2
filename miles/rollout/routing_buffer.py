"""A bounded store of routing records for R3 (--r3-buffer-size).

Between the rollout that records a sample's experts and the training step that replays them, a
sample waits (a whole rollout with --async-weight-sync, longer with partial rollouts). The buffer
holds the records of at most N samples, in the smallest integer type that fits the codes (int8
up to 125 experts: a record is (tokens, MoE layers, top_k), 1 byte per slot instead of 4 or 8),
and evicts the oldest first. Records leave the buffer when their samples are handed to
training; a sample whose record was evicted cannot be replayed and stops the run with the size
that would have held it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from miles.errors import MilesError

KEY = "routing_record"  # Sample.metadata key while the record waits here


def record_dtype(n_experts: int) -> np.dtype:
    """The smallest signed type for codes -1 .. n_experts - 1 and drops down to -(n_experts + 1)."""
    return np.dtype(np.int8) if n_experts + 1 <= 127 else np.dtype(np.int16)


class RoutingBuffer:
    def __init__(self, capacity: int, n_experts: int) -> None:
        self.capacity = capacity
        self.dtype = record_dtype(n_experts)
        self.records: OrderedDict[int, np.ndarray] = OrderedDict()
        self.next_key = 0
        self.evicted = 0
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def store(self, samples: Iterable) -> None:
        """Move each sample's record into the buffer (the sample keeps a key), evicting the oldest
        records beyond the capacity."""
        for s in samples:
            if s.rollout_routed_experts is None:
                continue
            self.records[self.next_key] = np.asarray(s.rollout_routed_experts).astype(self.dtype)
            s.metadata[KEY] = self.next_key
            s.rollout_routed_experts = None
            self.next_key += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        while len(self.records) > self.capacity:
            self.records.popitem(last=False)
            self.evicted += 1

    def take(self, samples: Iterable, in_flight: int) -> None:
        """Give each sample its record back (for training); `in_flight`: how many samples one
        step holds at once, for the error message."""
        for s in samples:
            if KEY not in s.metadata:
                continue
            key = s.metadata.pop(KEY)
            record = self.records.pop(key, None)
            if record is None:
                raise MilesError(
                    f"--r3-buffer-size {self.capacity}: the routing record of a sample was evicted before it was "
                    f"trained ({self.evicted} evicted so far), so its routing cannot be replayed. Samples waiting for "
                    f"training need up to {in_flight} records here; set --r3-buffer-size {in_flight} or more"
                )
            s.rollout_routed_experts = record

    def metrics(self) -> dict[str, float]:
        """Records held and the peak memory they took since the last call."""
        out = {
            "r3_buffer_records": len(self.records),
            "r3_buffer_peak_mb": self.peak_bytes / 1e6,
            "r3_buffer_evicted": self.evicted,
        }
        self.peak_bytes = self.nbytes
        return out
