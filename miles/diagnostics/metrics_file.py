"""A run's metrics.jsonl: written by `MetricsLogger` (every command that trains: `miles train`,
`miles dpo`), read by `miles plot` and `miles doctor`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from miles.errors import MilesError

log = logging.getLogger("miles")


def parse_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a line a killed run left half-written is skipped with a warning."""
    records = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise MilesError(f"{path}: not a metrics file of miles train (not UTF-8 text: {e.reason})") from e
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning(
                "%s: line %d is not whole JSON (a run killed while writing it?); skipped", path, number
            )
            continue
        if isinstance(record, dict) and type(record.get("rollout")) is int:
            records.append(record)
        else:
            log.warning("%s: line %d is not a metrics record; skipped", path, number)
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MilesError(f"{path}: no such file; is {run_dir} a miles run directory?")
    return parse_metrics(path)


class MetricsLogger:
    """metrics.jsonl (a line per `log`), and TensorBoard and wandb when asked."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "miles",
        config: dict | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.latest: dict[str, Any] = {}  # each metric's last logged value (the progress bar reads it)
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise MilesError(
                    "--use-tensorboard needs the tensorboard package: pip install tensorboard"
                ) from e
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            try:
                import os

                import wandb as wandb_lib
            except ImportError as e:
                raise MilesError("--use-wandb needs the wandb package: pip install wandb") from e
            os.environ.setdefault("WANDB_MODE", "offline")
            self.wb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config or {})

    def archive_previous(self) -> Path | None:
        """A new run in a used directory: keep the old metrics as metrics.<n>.jsonl, start empty."""
        if not self.path.exists():
            return None
        n = 1
        while (old := self.path.with_name(f"metrics.{n}.jsonl")).exists():
            n += 1
        self.path.rename(old)
        log.warning("%s held an earlier run's metrics; moved them to %s", self.path, old.name)
        return old

    def truncate_after(self, rollout_id: int) -> None:
        """Drop lines past `rollout_id` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        keep = [record for record in parse_metrics(self.path) if record["rollout"] <= rollout_id]
        self.path.write_text("".join(json.dumps(record) + "\n" for record in keep))

    def has(self, rollout_id: int, prefix: str) -> bool:
        """Whether a record of `rollout_id` holds a metric whose name starts with `prefix` (a
        resumed run asks whether an evaluation reached the file before the stop)."""
        if not self.path.exists():
            return False
        return any(
            r["rollout"] == rollout_id and any(k.startswith(prefix) for k in r)
            for r in parse_metrics(self.path)
        )

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        record = {"rollout": rollout_id, **metrics}
        self.latest.update(metrics)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, rollout_id)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(numeric, step=rollout_id)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
