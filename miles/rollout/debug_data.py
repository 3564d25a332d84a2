"""Saved rollouts, to split a problem in two: train on what a run generated, without an engine.

`--save-debug-rollout-data runs/x/rollout_{rollout_id}.pt` writes each rollout's groups after
scoring and filtering; `--debug-train-only --load-debug-rollout-data <same pattern>` trains on
them in a new run, which reproduces the original run's losses step for step. The file is a
`torch.save` of a dict: `format` ("miles-rollout-v1"), `rollout_id`, `metrics` (the rollout's
own: reward_mean, accuracy, ...) and `groups`, a list of groups, each a list of samples as
plain dicts of `miles.data.Sample`'s fields (`status` as its string, routing as numpy arrays).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from miles.data.sample import Sample, Status
from miles.errors import ConfigError, MilesError
from miles.rollout.sampling import Request
from miles.sync.transports import SyncStats

FORMAT = "miles-rollout-v1"


def rollout_file(pattern: str, rollout_id: int) -> Path:
    return Path(pattern.format(rollout_id=rollout_id))


def to_record(sample: Sample) -> dict:
    """A sample as a plain dict (`status` as its string), for torch.save."""
    return {**dataclasses.asdict(sample), "status": sample.status.value}


def from_record(record: dict) -> Sample:
    return Sample(**{**record, "status": Status(record["status"])})


def load_versioned(path: Path, fmt: str) -> dict:
    """A `torch.save`d dict whose `format` is `fmt` (ValueError otherwise)."""
    data = torch.load(path, weights_only=False)
    if data.get("format") != fmt:
        raise ValueError(f"format {data.get('format')!r}, expected {fmt!r}")
    return data


def save_rollout(pattern: str, rollout_id: int, groups: Sequence[Sequence[Sample]], metrics: dict) -> Path:
    path = rollout_file(pattern, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [[to_record(s) for s in g] for g in groups]
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, "rollout_id": rollout_id, "metrics": dict(metrics), "groups": records}, tmp)
    tmp.replace(path)
    return path


def load_rollout(pattern: str, rollout_id: int) -> tuple[list[list[Sample]], dict]:
    """(groups, the rollout's metrics) saved for `rollout_id`."""
    path = rollout_file(pattern, rollout_id)
    if not path.is_file():
        raise ConfigError(
            f"--load-debug-rollout-data: {path} (rollout {rollout_id}) does not exist; the saving run wrote "
            "one file per rollout it ran (give --num-rollout at most that many)"
        )
    try:
        data = load_versioned(path, FORMAT)
        groups = [[from_record(s) for s in g] for g in data["groups"]]
    except Exception as e:  # noqa: BLE001 - torn, foreign or from another version
        raise MilesError(f"--load-debug-rollout-data: {path} cannot be read ({e})") from e
    return groups, dict(data["metrics"])


class ReplayRollout:
    """The `Rollout` of a --debug-train-only run: no engine; its samples come from files."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.restarts, self.weight_version = tokenizer, 0, 0

    def generate(self, requests: Sequence[Request]) -> list[Sample]:
        raise MilesError("--debug-train-only has no engine to generate with")

    def node_ids(self) -> list[str]:
        return []

    def peak_memory(self) -> list[dict[str, int]]:
        return []

    def shutdown(self) -> None:
        pass


class NoSync:
    """Weight sync of a run without an engine: only the version moves."""

    name = "none (--debug-train-only: no engine)"

    def __init__(self, rollout: ReplayRollout) -> None:
        self.rollout = rollout

    def push(self, version: int) -> SyncStats:
        self.rollout.weight_version = version
        return SyncStats()
