"""Reward shaping applied after scoring: DAPO's soft overlong punishment.

A response of length n, with the cap L_max (--rollout-max-response-len) and a buffer L_cache
(--overlong-buffer-len), loses reward once it passes L_max - L_cache, linearly up to the factor F
(--overlong-penalty-factor) at the cap (DAPO, eq. 13; OpenRLHF's and verl's overlong buffer):

    penalty(n) = min(0, -(n - (L_max - L_cache)) / L_cache * F)
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.data.sample import Sample


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """The (non-positive) reward added to a response of `length` tokens."""
    return min(0.0, -(length - (max_len - buffer)) / buffer * factor)


def shape_overlong(samples: Sequence[Sample], max_len: int, buffer: int, factor: float) -> dict[str, float]:
    """Add each sample's overlong penalty to its reward; the rollout's penalty metrics."""
    penalties = [overlong_penalty(s.response_length, max_len, buffer, factor) for s in samples]
    for s, p in zip(samples, penalties):
        s.reward += p
    return {
        "overlong_penalty_mean": sum(penalties) / len(penalties),
        "overlong_frac": sum(p < 0 for p in penalties) / len(penalties),
    }
