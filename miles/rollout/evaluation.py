"""Held-out evaluation: named evaluation sets, several samples per prompt, pass@k.

The run's default set is its held-out problems (`--eval-size` of the task, or
`--eval-prompt-data`), logged as `eval_*`. `--eval-config FILE` adds named sets, each a task or
a prompt file with its own samples per prompt and temperature, logged as `eval_<name>_*`. With
one sample per prompt a set is decoded greedily (unless it names a temperature); with n it is
sampled, with seeds that depend only on the prompt and the sample (every evaluation of the run,
and `miles eval` of a checkpoint, draws the same), and reports pass@k for k = 1, 2, 4, ... and n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem, file_prompts, task_prompts
from miles.errors import ConfigError
from miles.rewards.runner import RewardRunner
from miles.rollout.groups import generate_groups

EVAL_SEED = 7_919  # the sampling seeds of evaluation, apart from training's


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which `correct` are right (Chen et al.,
    2021): 1 - C(n - c, k) / C(n, k), computed as a product so large n does not overflow."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


def ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two up to n, and n."""
    return sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})


@dataclass
class EvalSet:
    name: str  # "" for the run's default set (metrics eval_*), else eval_<name>_*
    items: list[PromptItem]
    n_samples: int = 1
    temperature: float | None = None  # None: greedy with one sample, the rollout's with more
    rewards: RewardRunner | None = None  # None: the run's

    def prefix(self) -> str:
        return f"eval_{self.name}_" if self.name else "eval_"


def evaluate(engine, eval_set: EvalSet, cfg: RunConfig, rewards: RewardRunner, mode=None) -> dict[str, float]:
    """One set's metrics: accuracy (`Sample.correct`) and mean reward over every sample, mean response
    length, and with n > 1 pass@k (a forking agent's last branch counts per sample)."""
    n = eval_set.n_samples
    temperature = eval_set.temperature
    if temperature is None:
        temperature = 0.0 if n == 1 else cfg.rollout.rollout_temperature
    groups = generate_groups(engine, eval_set.items, cfg, -1, n, temperature, EVAL_SEED, mode)
    (eval_set.rewards or rewards).score_groups(groups)
    if mode is not None:  # one sample per request: the last branch of each
        groups = [g[-1:] if len(g) > n else g for g in groups]
    samples = [s for g in groups for s in g]
    p = eval_set.prefix()
    out = {
        f"{p}accuracy": sum(s.correct for s in samples) / len(samples),
        f"{p}reward": sum(s.reward for s in samples) / len(samples),
        f"{p}response_len": sum(s.response_length for s in samples) / len(samples),
    }
    if n > 1:
        correct = [sum(s.correct for s in g) for g in groups]
        for k in ks(n):
            out[f"{p}pass@{k}"] = sum(pass_at_k(len(g), c, k) for g, c in zip(groups, correct)) / len(groups)
    return out


def evaluate_all(
    engine, sets: list[EvalSet], cfg: RunConfig, rewards: RewardRunner, mode=None
) -> dict[str, float]:
    out: dict[str, float] = {}
    for eval_set in sets:
        out.update(evaluate(engine, eval_set, cfg, rewards, mode))
    return out


def eval_sets_of(cfg: RunConfig, data) -> list[EvalSet]:
    """The run's evaluation sets: its held-out set (when it has one) and --eval-config's."""
    data_cfg = cfg.data
    sets = []
    if data.eval_items:
        sets.append(
            EvalSet("", data.eval_items, data_cfg.n_samples_per_eval_prompt, data_cfg.eval_temperature)
        )
    if data_cfg.eval_config and not cfg.debug.debug_train_only:
        sets += load_eval_config(data_cfg.eval_config, cfg.train.seed)
    return sets


SET_KEYS = {"name", "task", "task_config", "size", "prompt_data", "input_key", "label_key", "metadata_key",
            "n_samples", "temperature"}  # fmt: skip


def load_eval_config(path: str, seed: int) -> list[EvalSet]:
    """The named sets of an --eval-config YAML file: `eval: [{name, task | prompt_data, ...}]`."""
    import yaml

    where = f"--eval-config {path}"
    if not Path(path).is_file():
        raise ConfigError(f"{where}: no such file")
    data = yaml.safe_load(Path(path).read_text()) or {}
    entries = data.get("eval") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{where}: expected a top-level 'eval:' list of sets, each with a name and a task or prompt_data"
        )
    sets, names = [], set()
    for i, entry in enumerate(entries):
        at = f"{where}, set {i + 1}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: expected a mapping")
        unknown = set(entry) - SET_KEYS
        if unknown:
            raise ConfigError(f"{at}: unknown key(s) {sorted(unknown)}; a set takes {sorted(SET_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name.replace("_", "").isalnum() or name in names:
            raise ConfigError(
                f"{at}: needs a unique 'name' of letters, digits and _ (it names the metrics), got {name!r}"
            )
        names.add(name)
        if ("task" in entry) == ("prompt_data" in entry):
            raise ConfigError(f"{at} ({name}): give exactly one of 'task' or 'prompt_data'")
        n = entry.get("n_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{at} ({name}): n_samples must be a positive integer, got {n!r}")
        temperature = entry.get("temperature")
        if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
            raise ConfigError(f"{at} ({name}): temperature must be a number >= 0, got {temperature!r}")
        rewards: Any = None
        if "task" in entry:
            items, dataset = task_prompts(
                entry["task"], int(entry.get("size", 100)), seed + 10_007, entry.get("task_config") or {}
            )
            rewards = RewardRunner("auto", None, False, 30.0, dataset)  # the set's own scorer
        else:
            items = file_prompts(entry["prompt_data"], entry.get("input_key", "input"), entry.get("label_key", "label"),
                                 entry.get("metadata_key"), f"{at} ({name}) prompt_data")  # fmt: skip
        sets.append(EvalSet(name, items, n, None if temperature is None else float(temperature), rewards))
    return sets
