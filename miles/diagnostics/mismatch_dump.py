"""What `miles doctor --localize-mismatch` replays (--mismatch-dump-interval N): a few samples of
one rollout, the weights the trainer held when the engine generated them, and the weights the
engine served. One file, `<run dir>/mismatch.pt`, replaced by each dump (the latest is kept)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.data.sample import Sample
from miles.errors import MilesError
from miles.rollout.debug_data import from_record, load_versioned, to_record

FILE = "mismatch.pt"
FORMAT = "miles-mismatch-v1"


@dataclass
class MismatchDump:
    rollout_id: int
    samples: list[Sample]
    trainer: dict[str, torch.Tensor]  # the trainer's model state (module names)
    engine: dict[str, torch.Tensor] | None  # the engine's model state as served; None: not readable


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def save_dump(
    run_dir: Path,
    rollout_id: int,
    samples: Sequence[Sample],
    trainer: dict[str, torch.Tensor],
    engine: dict[str, torch.Tensor] | None,
) -> Path:
    path = Path(run_dir) / FILE
    tmp = path.with_name(path.name + ".tmp")
    data = {
        "format": FORMAT,
        "rollout_id": rollout_id,
        "samples": [to_record(s) for s in samples],
        "trainer": _copy(trainer),
        "engine": None if engine is None else _copy(engine),
    }
    torch.save(data, tmp)
    tmp.replace(path)  # a dump is whole or absent
    return path


def load_dump(run_dir: Path) -> MismatchDump:
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise MilesError(
            f"miles doctor --localize-mismatch: {path} does not exist; run miles train with "
            "--mismatch-dump-interval N (e.g. 1) to keep what the replay needs"
        )
    try:
        data = load_versioned(path, FORMAT)
        samples = [from_record(r) for r in data["samples"]]
    except Exception as e:  # noqa: BLE001 - torn, foreign or from another version
        raise MilesError(f"miles doctor --localize-mismatch: {path} cannot be read ({e})") from e
    return MismatchDump(data["rollout_id"], samples, data["trainer"], data["engine"])
