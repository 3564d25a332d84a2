"""Reading a run's metrics.jsonl (what `miles train` writes, `miles plot` and `miles doctor` read)."""

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
