"""Training checkpoints: model, optimizer, scheduler, RNG and data position, written atomically.

Layout: SAVE/iter_0000010/ (an HF checkpoint + trainer_state.pt) and SAVE/latest (the newest
iteration number). Each iteration is written to a temporary directory and renamed into place,
then `latest` is replaced atomically, so a run killed at any moment leaves only whole checkpoints.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.errors import CheckpointError, ConfigError
from miles.models.checkpoint import load_state_dict_into as _load_into
from miles.models.checkpoint import read_tensors, save_model, tensor_files

log = logging.getLogger("miles")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(save_dir: str | Path, rollout_id: int, model, tokenizer, state: dict[str, Any]) -> Path:
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / f"iter_{rollout_id:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp_iter_", dir=save_dir))
    try:
        save_model(model, tmp / "model", tokenizer=tokenizer)
        torch.save({**state, "rng": rng_state(), "rollout_id": rollout_id}, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = save_dir / ".latest.tmp"
    latest_tmp.write_text(str(rollout_id))
    os.replace(latest_tmp, save_dir / "latest")
    return final


def clear_stale(save_dir: str | Path) -> None:
    """Remove temp dirs a killed run left behind (never a checkpoint: `latest` never names one)."""
    for tmp in Path(save_dir).glob(".tmp_iter_*"):
        shutil.rmtree(tmp, ignore_errors=True)


def latest_checkpoint(load_dir: str | Path) -> Path | None:
    load_dir = Path(load_dir)
    marker = load_dir / "latest"
    if not marker.exists():
        return None
    path = load_dir / f"iter_{int(marker.read_text().strip()):07d}"
    if not (path / "trainer_state.pt").exists():
        raise ConfigError(f"--load {load_dir}: 'latest' names {path.name}, which is incomplete or missing")
    return path


def load_checkpoint(path: Path, model) -> dict[str, Any]:
    """Load weights into `model` (checked tensor by tensor) and return the trainer state."""
    try:
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        state["rng"], state["rollout_id"]  # noqa: B018 - a torn or foreign file fails here
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, or not ours
        raise CheckpointError(f"{path / 'trainer_state.pt'}: cannot be read ({type(e).__name__}: {e})") from e
    files = tensor_files(path / "model")
    state_dict = read_tensors(path / "model", files, files.keys())
    _load_into(model, state_dict, str(path / "model"))
    set_rng_state(state["rng"])
    return state


def load_latest(load_dir: str | Path, model) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `load_dir` that loads (into `model`) and its trainer state; a
    corrupt newer one is named in a warning and the one before it is tried. None: no checkpoint."""
    latest = latest_checkpoint(load_dir)
    if latest is None:
        return None
    older = sorted(
        (
            p
            for p in Path(load_dir).glob("iter_*")
            if p.name < latest.name and (p / "trainer_state.pt").exists()
        ),
        reverse=True,
    )
    errors = []
    for path in [latest, *older]:
        try:
            return path, load_checkpoint(path, model)
        except CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint %s cannot be loaded (%s); trying the one before it", path.name, e)
    raise CheckpointError(f"--load {load_dir}: no checkpoint loads; the newest: {errors[0]}")
