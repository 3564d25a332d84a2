"""Scoring samples: built-ins, reasoning-gym scorers, or a user's function by `module:function`.

A reward function that raises, times out or returns a non-number marks that sample FAILED with
reward 0; the run continues and the failures are counted in the metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles.data.sample import Sample, Status
from miles.errors import ConfigError
from miles.rewards.builtin import boxed_answer, exact_match


def load_function(path: str, flag: str) -> Callable:
    """Import `module:function` (a module name, or a .py file path before the colon)."""
    if ":" not in path:
        raise ConfigError(f"{flag} {path!r}: expected module:function, e.g. my_rewards:score")
    module_name, func_name = path.rsplit(":", 1)
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise ConfigError(f"{flag} {path!r}: no such file {file}")
            spec = importlib.util.spec_from_file_location(file.stem, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[file.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{flag} {path!r}: cannot import {module_name!r} ({e})") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{flag} {path!r}: {module_name} has no function {func_name!r}")
    return func


def _call(func: Callable, *args: Any) -> Any:
    result = func(*args)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable


class RewardRunner:
    """Fills `sample.reward` for groups of samples; counts failures."""

    def __init__(
        self, rm_type: str, custom_path: str | None, group_rm: bool, timeout: float, task_dataset=None
    ) -> None:
        self.timeout, self.group_rm, self.task_dataset = timeout, group_rm, task_dataset
        self.custom = load_function(custom_path, "--custom-rm-path") if custom_path else None
        if rm_type == "reasoning_gym" and task_dataset is None and self.custom is None:
            raise ConfigError("--rm-type reasoning_gym needs --task")
        self.rm_type = (
            rm_type if rm_type != "auto" else ("reasoning_gym" if task_dataset is not None else "exact")
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="miles-reward")
        self.failures = 0

    def builtin(self, sample: Sample) -> float:
        if self.rm_type == "reasoning_gym":
            return float(self.task_dataset.score_answer(sample.response.strip(), sample.metadata["rg_entry"]))
        if self.rm_type == "boxed":
            return boxed_answer(sample.response, sample.label)
        return exact_match(sample.response, sample.label)

    def _timed(self, func: Callable, *args: Any) -> Any:
        return self.pool.submit(_call, func, *args).result(timeout=self.timeout)

    def score_groups(self, groups: Sequence[Sequence[Sample]]) -> int:
        """Score every sample in place; returns how many failed in this call."""
        failed = 0
        for group in groups:
            if self.custom is not None and self.group_rm:
                try:
                    rewards = list(self._timed(self.custom, list(group)))
                    if len(rewards) != len(group):
                        raise ValueError(f"returned {len(rewards)} rewards for {len(group)} samples")
                except Exception as e:
                    rewards = [e] * len(group)
            else:
                rewards = []
                for s in group:
                    try:
                        rewards.append(self._timed(self.custom, s) if self.custom else self.builtin(s))
                    except Exception as e:
                        rewards.append(e)
            for s, r in zip(group, rewards):
                value = r.get("score") if isinstance(r, dict) else r
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if ok:
                    s.reward = float(value)
                else:
                    s.reward, s.status = 0.0, Status.FAILED
                    s.metadata["reward_error"] = (
                        repr(r) if isinstance(r, Exception) else f"non-numeric reward {r!r}"
                    )
                    failed += 1
        self.failures += failed
        return failed
