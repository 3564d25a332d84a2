"""A finished (or stopped) run as the doctor reads it: its resolved config and its metrics."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.diagnostics.metrics_file import parse_metrics
from miles.errors import MilesError


@dataclass
class RunRecord:
    path: Path
    config: dict[str, dict[str, Any]]  # config.yaml: section -> key -> value
    records: list[dict[str, Any]]  # metrics.jsonl, one dict per line

    def setting(self, dotted: str, default: Any = None) -> Any:
        """`run.setting("algo.use_tis")`: the run's resolved value (older runs may lack a key)."""
        section, key = dotted.split(".")
        return (self.config.get(section) or {}).get(key, default)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The RL steps (records of a rollout that trained or was skipped; not the step -1 eval)."""
        return [r for r in self.records if r.get("rollout", -1) >= 0 and "reward_mean" in r]

    def series(self, key: str) -> list[tuple[int, float]]:
        """(rollout, value) of every step that logged `key`, NaN and inf included."""
        return [(r["rollout"], float(r[key])) for r in self.steps if isinstance(r.get(key), (int, float))]

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.series(key)]

    def median(self, key: str) -> float | None:
        finite = [v for v in self.values(key) if math.isfinite(v)]
        return statistics.median(finite) if finite else None

    def evals(self) -> list[tuple[int, float]]:
        return [(r["rollout"], float(r["eval_accuracy"])) for r in self.records if "eval_accuracy" in r]


def load_run(run_dir: str | Path) -> RunRecord:
    """The run in `run_dir` (what `miles train --output-dir` wrote)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise MilesError(
            f"miles doctor: {path} is not a directory; give a run directory (--output-dir of miles train)"
        )
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        raise MilesError(f"miles doctor: {path} has no metrics.jsonl; is it a run directory of miles train?")
    config_file = path / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    return RunRecord(path, config or {}, parse_metrics(metrics))  # torn lines skipped, as miles plot does
