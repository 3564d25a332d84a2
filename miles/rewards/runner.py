"""Scoring samples: built-ins, reasoning-gym scorers, or a user's function by `module:function`.

A user's function runs in killable worker processes (`miles.rewards.workers`): one that raises,
hangs past --reward-timeout, exits or returns a non-number marks that sample FAILED with reward
0 and the run goes on. `--rm-type code` runs the response's program on the label's tests in
sandboxed processes (`miles.rewards.code`). The first failure of each kind is printed with its traceback, the rest
are counted (`reward_failed` per step); a rollout whose every reward failed stops the run.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.data.sample import Sample, Status
from miles.errors import ConfigError, MilesError
from miles.rewards.builtin import boxed_answer, exact_match, last_number
from miles.rewards.code import CodeLimits, code_rewards
from miles.rewards.functions import load_function
from miles.rewards.remote import JUDGE_TEMPLATE, JudgeReward, RemoteReward
from miles.rewards.reward_model import ModelReward
from miles.rewards.workers import RewardFailure, RewardWorkers

log = logging.getLogger("miles")


def as_reward(result: Any) -> float | RewardFailure:
    """A finite number (or {"score": number}) as the reward; anything else as a failure."""
    value = result.get("score") if isinstance(result, dict) else result
    if isinstance(result, RewardFailure):
        return result
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return RewardFailure("NonNumericReward", f"non-numeric reward {result!r} ({type(value).__name__})")
    if not math.isfinite(value):
        return RewardFailure("NonFiniteReward", f"non-finite reward {value!r}")
    return float(value)


class RewardRunner:
    """Fills `sample.reward` for groups of samples; counts and reports failures."""

    def __init__(
        self,
        rm_type: str,
        custom_path: str | None,
        group_rm: bool,
        timeout: float,
        task_dataset=None,
        num_workers: int = 4,
        remote: RemoteReward | None = None,
        code_limits: CodeLimits | None = None,
        model_reward: ModelReward | None = None,
    ) -> None:
        """`model_reward`: --rm-type model's reward model (the task's own scorer, where there is a
        task, still gives each sample's `task_reward`: the verifiable accuracy beside the proxy)."""
        self.timeout, self.group_rm, self.task_dataset = timeout, group_rm, task_dataset
        self.custom_path, self.remote, self.model_reward = custom_path, remote, model_reward
        self.code_limits, self.num_workers = code_limits or CodeLimits(), num_workers
        self.workers = None
        if custom_path:
            load_function(custom_path, "--custom-rm-path")  # a bad path fails here, before any work
            self.workers = RewardWorkers(custom_path, num_workers, timeout)
        if rm_type == "reasoning_gym" and task_dataset is None and custom_path is None:
            raise ConfigError("--rm-type reasoning_gym needs --task")
        self.rm_type = (
            rm_type if rm_type != "auto" else ("reasoning_gym" if task_dataset is not None else "exact")
        )
        self.failure_kinds: Counter[str] = Counter()
        self.first_failure: RewardFailure | None = None

    def builtin(self, sample: Sample) -> float:
        if self.rm_type == "reasoning_gym":
            return float(self.task_dataset.score_answer(sample.response.strip(), sample.metadata["rg_entry"]))
        if self.rm_type == "boxed":
            return boxed_answer(sample.response, sample.label)
        if self.rm_type == "last_number":
            return last_number(sample.response, sample.label)
        return exact_match(sample.response, sample.label)

    def _builtin_or_failure(self, sample: Sample) -> Any:
        try:
            return self.builtin(sample)
        except Exception as e:  # noqa: BLE001 - a scorer's error fails this sample only
            return RewardFailure(type(e).__name__, str(e) or repr(e), traceback.format_exc())

    @classmethod
    def from_config(cls, cfg, task_dataset) -> RewardRunner:
        """The run's rewards: --custom-rm-path, --rm-type (remote_rm: --rm-url) and their settings."""
        rc = cfg.reward
        remote = None
        if rc.rm_type == "remote_rm":
            remote = RemoteReward(
                rc.rm_url, rc.reward_timeout, rc.rm_batch_size, rc.rm_max_concurrency, rc.rm_retries
            )
        elif rc.rm_type == "llm_judge":
            template = Path(rc.judge_template).read_text() if rc.judge_template else JUDGE_TEMPLATE
            remote = JudgeReward(rc.rm_url, rc.judge_model, template, rc.reward_timeout, rc.rm_max_concurrency,
                                 rc.rm_retries)  # fmt: skip
        limits = CodeLimits(rc.code_timeout, math.ceil(rc.code_timeout), rc.code_memory_mb, rc.code_file_mb)
        model_reward = ModelReward(rc.rm_path, rc.rm_batch_size) if rc.rm_type == "model" else None
        return cls(rc.rm_type, rc.custom_rm_path, rc.group_rm, rc.reward_timeout, task_dataset,
                   rc.reward_num_workers, remote, limits, model_reward)  # fmt: skip

    def _rewards(self, groups: Sequence[Sequence[Sample]]) -> list[Any]:
        """One raw result per sample, in order (a value or a `RewardFailure`)."""
        samples = [s for g in groups for s in g]
        if self.model_reward is not None:
            return self.model_reward.score(samples)
        if self.remote is not None and self.workers is None:
            return self.remote.map(samples)
        if self.workers is None and self.rm_type == "code":
            return code_rewards(samples, self.code_limits, self.num_workers)
        if self.workers is None:
            return [self._builtin_or_failure(s) for s in samples]
        if not self.group_rm:
            return self.workers.map([(s,) for s in samples])
        out = []
        for group, result in zip(groups, self.workers.map([(list(g),) for g in groups])):
            if not isinstance(result, RewardFailure) and (
                not isinstance(result, (list, tuple)) or len(result) != len(group)
            ):
                n = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
                result = RewardFailure("BadGroupResult", f"returned {n} rewards for a group of {len(group)}")
            out.extend(result if isinstance(result, (list, tuple)) else [result] * len(group))
        return out

    def score_groups(self, groups: Sequence[Sequence[Sample]]) -> int:
        """Score every sample in place; returns how many failed in this call."""
        samples = [s for g in groups for s in g]
        failed = 0
        for s, raw in zip(samples, self._rewards(groups)):
            if "agent_reward" in s.metadata:  # a black-box agent scored its own episode
                raw = s.metadata["agent_reward"]
            reward = as_reward(raw)
            if isinstance(reward, RewardFailure):
                s.reward, s.status = 0.0, Status.FAILED
                s.metadata["reward_error"] = str(reward)
                self._report(reward)
                failed += 1
            else:
                s.reward = reward
                if isinstance(raw, dict):
                    s.metadata["reward_info"] = {k: v for k, v in raw.items() if k != "score"}
            if self.model_reward is not None and self.task_dataset is not None:
                s.metadata["task_reward"] = float(
                    self.task_dataset.score_answer(s.response.strip(), s.metadata["rg_entry"])
                )
        return failed

    def _report(self, failure: RewardFailure) -> None:
        """Print the first failure of each kind in full; count the rest."""
        if self.first_failure is None:
            self.first_failure = failure
        self.failure_kinds[failure.kind] += 1
        if self.failure_kinds[failure.kind] == 1:
            where = self.custom_path or (
                f"--rm-url {self.remote.url}" if self.remote else f"--rm-type {self.rm_type}"
            )
            log.error(
                "reward %s failed: %s (further failures of this kind are counted in reward_failed)%s",
                where,
                failure,
                "\n" + failure.traceback.rstrip() if failure.traceback else "",
            )

    def check_rollout(self, failed: int, total: int, rollout_id: int) -> None:
        """Stop the run when no sample of a rollout got a reward: nothing could be learned."""
        if total and failed == total:
            raise MilesError(
                f"every reward of rollout {rollout_id} failed ({failed}/{total}); the first: {self.first_failure}. "
                f"Fix the reward function ({self.custom_path or self.rm_type}); the traceback is printed above"
            )

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
