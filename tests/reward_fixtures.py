"""Misbehaving reward functions for --custom-rm-path in tests. Kept free of heavy imports: a
reward process killed by a failure is replaced, and its replacement imports this module again."""

from __future__ import annotations

import math
import os
import sys


def always_raises(sample):
    raise ValueError(f"cannot parse {sample.response[:10]!r}")


def returns_none(sample):
    return None


def returns_nan(sample):
    return math.nan


def returns_text(sample):
    return "correct"


def exits(sample):
    sys.exit(3)


def dies(sample):
    os._exit(7)


def dies_once(marker: str) -> float:
    """Kills its process on the first call for `marker` (as an outside kill would), then answers."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return 1.0


LEAKED: list[bytearray] = []


def leaky_filter(group) -> bool:
    """A --dynamic-sampling-filter-path that keeps every group and 16 MB per call (a leak)."""
    LEAKED.append(bytearray(b"\x01") * (16 * 1024**2))
    return True
