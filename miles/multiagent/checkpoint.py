"""Checkpoints of a multi-agent run, and resuming from them.

SAVE/iter_<step>/agents/<name>/ holds each agent's weights (an HF checkpoint) and
SAVE/iter_<step>/trainer_state.pt everything else a run needs to continue exactly: each agent's
optimizer, baseline, weight version and population snapshots, the loop's random state, and the
environment's and tracker's own state (their `state_dict`, when they have one). Written whole
or not at all, with the same `latest` marker as a single-policy run
(`miles.runtime.train_state`).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from pathlib import Path
from typing import Any

import torch

from miles.errors import CheckpointError
from miles.models.checkpoint import atomic_directory, read_tensors, save_model, tensor_files
from miles.models.checkpoint import load_state_dict_into as _load_into
from miles.runtime.train_state import clear_stale, latest_checkpoint, mark_latest, rng_state, set_rng_state

log = logging.getLogger("miles")


def _state(obj) -> dict | None:
    return obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None


def save_agents(
    save_dir: str | Path, step: int, agents: dict, tokenizer, rng: random.Random, env, tracker
) -> Path:
    save_dir = Path(save_dir)
    final = save_dir / f"iter_{step:07d}"
    with atomic_directory(final) as tmp:
        for name, agent in agents.items():
            save_model(agent.policy(), tmp / "agents" / name, tokenizer=tokenizer)
        state: dict[str, Any] = {
            "agents": {
                name: {
                    "trainer": agent.executor.trainer.state_dict(),
                    "baseline": agent.baseline,
                    "version": agent.version,
                    "snapshots": list(agent.snapshots),
                }
                for name, agent in agents.items()
            },
            "loop_rng": rng.getstate(),
            "env": _state(env),
            "tracker": _state(tracker),
            "rng": rng_state(),
            "rollout_id": step,
        }
        torch.save(state, tmp / "trainer_state.pt")
    mark_latest(save_dir, step)
    return final


def resume_agents(cfg, agents: dict, rng: random.Random, env, tracker, metrics) -> int:
    """The first step to run: after --load's latest checkpoint (every agent's weights, optimizer,
    baseline and snapshots, the engines' weights and all random state restored, later metrics
    dropped), else 0."""
    for d in (cfg.checkpoint.save, cfg.checkpoint.load):
        if d:
            clear_stale(d)
    path = latest_checkpoint(cfg.checkpoint.load) if cfg.checkpoint.load else None
    if path is None:
        metrics.archive_previous()
        return 0
    try:
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        saved = state["agents"]
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, or not a multi-agent checkpoint
        raise CheckpointError(
            f"{path / 'trainer_state.pt'}: not a readable multi-agent checkpoint ({type(e).__name__}: {e})"
        ) from e
    if set(saved) != set(agents):
        raise CheckpointError(f"{path}: holds agents {sorted(saved)}, this environment has {sorted(agents)}")
    for name, agent in agents.items():
        folder = path / "agents" / name
        files = tensor_files(folder)
        policy = agent.executor.trainer.policy
        _load_into(policy, read_tensors(folder, files, files.keys()), str(folder))
        agent.executor.trainer.load_state_dict(saved[name]["trainer"])
        agent.baseline, agent.version = saved[name]["baseline"], saved[name]["version"]
        agent.snapshots = deque(saved[name]["snapshots"], maxlen=agent.snapshots.maxlen)
        agent.push(agent.version)  # the engine takes the restored weights
    rng.setstate(state["loop_rng"])
    for obj, key in ((env, "env"), (tracker, "tracker")):
        if state[key] is not None:
            obj.load_state_dict(state[key])
    set_rng_state(state["rng"])
    metrics.truncate_after(state["rollout_id"])
    log.info("resumed from %s at step %d", path, state["rollout_id"] + 1)
    return state["rollout_id"] + 1
