"""Training checkpoints (model, optimizer, scheduler, RNG, data position), written atomically,
and resuming a run from them.

Layout: SAVE/iter_0000010/ (an HF checkpoint + trainer_state.pt) and SAVE/latest (the newest
iteration number). Each iteration is written to a temporary directory and renamed into place,
then `latest` is replaced atomically, so a run killed at any moment leaves only whole checkpoints.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.errors import CheckpointError, ConfigError
from miles.lora.adapters import spec_of
from miles.lora.peft_files import is_adapter_dir, load_adapter, save_adapter
from miles.models.checkpoint import atomic_directory, read_tensors, save_model, tensor_files
from miles.models.checkpoint import load_state_dict_into as _load_into

log = logging.getLogger("miles")

# trainer_state.pt's layout. 2: adds what async, partial and online-draft runs carry ("ahead",
# "partial", "draft"); a format-1 file (no "format" key) loads, and a run of one of those modes
# is told its next rollout is generated afresh.
CHECKPOINT_FORMAT = 2


def carries_mode_state(state: dict[str, Any]) -> bool:
    """Whether a loaded trainer state is of a format that holds the async/partial/draft state."""
    return state.get("format", 1) >= 2


class NewerCheckpoint(CheckpointError):
    """Written by a newer miles: not damaged, so no older checkpoint is tried instead."""


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    models: Mapping[str, Any],
    tokenizer,
    state: dict[str, Any],
    written: Callable[[], None] | None = None,
) -> Path:
    """SAVE/iter_<rollout>, written whole or not at all: each model as an HF checkpoint in its
    subdirectory ({"model": policy} for one policy, {"agents/a": ...} for several) and the
    trainer state; then `latest` names it (atomically). `written`: called once the models are
    on disk and the checkpoint is not yet complete (fault injection)."""
    save_dir = Path(save_dir)
    final = save_dir / f"iter_{rollout_id:07d}"
    with atomic_directory(final) as tmp:
        for folder, model in models.items():
            if spec_of(model) is not None:  # LoRA: the adapter (PEFT files); the base is --model's
                save_adapter(model, tmp / folder)
            else:
                save_model(model, tmp / folder, tokenizer=tokenizer)
        if written is not None:
            written()
        torch.save(
            {**state, "rng": rng_state(), "rollout_id": rollout_id, "format": CHECKPOINT_FORMAT},
            tmp / "trainer_state.pt",
        )
    mark_latest(save_dir, rollout_id)
    return final


def mark_latest(save_dir: Path, rollout_id: int) -> None:
    """Point SAVE/latest at iter_<rollout_id> (atomically: a reader sees the old or the new)."""
    latest_tmp = save_dir / ".latest.tmp"
    latest_tmp.write_text(str(rollout_id))
    os.replace(latest_tmp, save_dir / "latest")


def clear_stale_of(cfg) -> None:
    """Temp dirs a killed run left in --save and --load."""
    for d in (cfg.checkpoint.save, cfg.checkpoint.load):
        if d:
            clear_stale(d)


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


def load_checkpoint(path: Path, models: Mapping[str, Any]) -> dict[str, Any]:
    """Load each model's weights from its subdirectory (checked tensor by tensor) and return the
    trainer state."""
    try:
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        state["rng"], state["rollout_id"]  # noqa: B018 - a torn or foreign file fails here
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, or not ours
        raise CheckpointError(f"{path / 'trainer_state.pt'}: cannot be read ({type(e).__name__}: {e})") from e
    if state.get("format", 1) > CHECKPOINT_FORMAT:
        raise NewerCheckpoint(
            f"{path}: written by a newer miles (checkpoint format {state['format']}; this one reads up to "
            f"{CHECKPOINT_FORMAT}); upgrade miles to resume it"
        )
    for folder, model in models.items():
        if is_adapter_dir(path / folder) or spec_of(model) is not None:
            load_run_adapter(model, path / folder)
            continue
        files = tensor_files(path / folder)
        _load_into(model, read_tensors(path / folder, files, files.keys()), str(path / folder))
    set_rng_state(state["rng"])
    return state


def load_run_adapter(model, folder: Path) -> None:
    """A LoRA run's checkpoint holds its adapter; a run resumes it only with adapters of its own."""
    if spec_of(model) is None:
        raise CheckpointError(f"{folder} holds a LoRA adapter; resume it with the same --lora-rank flags")
    if not is_adapter_dir(folder):
        raise CheckpointError(
            f"{folder} holds whole weights, not a LoRA adapter; this run has --lora-rank (start from the weights "
            "with --model, not --load)"
        )
    load_adapter(model, folder)


def load_latest(load_dir: str | Path, models: Mapping[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `load_dir` that loads (into `models`) and its trainer state; a
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
            return path, load_checkpoint(path, models)
        except NewerCheckpoint:
            raise
        except CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint %s cannot be loaded (%s); trying the one before it", path.name, e)
    raise CheckpointError(f"--load {load_dir}: no checkpoint loads; the newest: {errors[0]}")


def resume(cfg, policy, metrics) -> tuple[int, dict[str, Any], Path | None]:
    """The first rollout to run, the checkpoint's state and its path: after the latest loadable
    checkpoint of --load (the policy's weights loaded, the RNG restored, later metrics dropped;
    the run restores the rest of the state), else (0, {}, None) (old metrics moved aside)."""
    clear_stale_of(cfg)
    if cfg.checkpoint.load and (loaded := load_latest(cfg.checkpoint.load, {"model": policy})) is not None:
        ckpt, state = loaded
        metrics.truncate_after(state["rollout_id"])
        return state["rollout_id"] + 1, state, ckpt
    metrics.archive_previous()
    return 0, {}, None
