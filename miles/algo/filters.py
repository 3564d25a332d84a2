"""Group filters for dynamic sampling (DAPO): which prompt groups are worth training on.

A filter takes one group (the samples of one prompt, each with a `.reward`) and returns True to
keep it. Users plug in their own with `--dynamic-sampling-filter-path module:function`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

GroupFilter = Callable[[Sequence[Any]], bool]


def _reward(sample: Any) -> float:
    r = sample.reward
    return float(r["score"] if isinstance(r, dict) else r)


def nonconstant_reward(group: Sequence[Any]) -> bool:
    """Keep groups whose rewards are not all equal: an all-equal group has zero GRPO advantage."""
    rewards = [_reward(s) for s in group]
    return any(not math.isclose(r, rewards[0], rel_tol=0, abs_tol=1e-9) for r in rewards[1:])


def apply_filter(groups: Sequence[Sequence[Any]], keep: GroupFilter) -> tuple[list, int]:
    """(kept groups, number dropped)."""
    kept = [g for g in groups if keep(g)]
    return kept, len(groups) - len(kept)
