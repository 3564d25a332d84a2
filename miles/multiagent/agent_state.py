"""Checkpoints of a multi-agent run, and resuming from them.

The single-policy checkpoint format (`miles.runtime.train_state`) with one model per agent:
SAVE/iter_<step>/agents/<name>/ holds each agent's weights (an HF checkpoint) and
SAVE/iter_<step>/trainer_state.pt everything else a run needs to continue exactly: each agent's
optimizer, baseline, weight version, population snapshots and KL reference, the loop's random state, and the
environment's and tracker's own state (their `state_dict`, when they have one). Written whole or
not at all, with the same `latest` marker; a corrupt newest checkpoint falls back to the one
before it, as a single-policy run's does.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.errors import CheckpointError
from miles.runtime.train_state import clear_stale_of, latest_checkpoint, load_latest, save_checkpoint

log = logging.getLogger("miles")


def _state(obj) -> dict | None:
    return obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None


def save_agents(
    save_dir: str | Path,
    step: int,
    agents: dict,
    tokenizer,
    rng: random.Random,
    env,
    tracker,
    parts: dict[str, Any] | None = None,
    written: Callable[[], None] | None = None,
) -> Path:
    """`parts`: the run parts' state (`Parts.state_dict`); `written`: called once the models are
    on disk and the checkpoint is not yet complete (the parts' `checkpoint` phase)."""
    state: dict[str, Any] = {
        **(parts or {}),
        "agents": {
            name: {
                "trainer": agent.executor.trainer.state_dict(),
                "baseline": agent.baseline,
                "version": agent.version,
                "snapshots": list(agent.snapshots),
                "reference": agent.reference,
            }
            for name, agent in agents.items()
        },
        "loop_rng": rng.getstate(),
        "env": _state(env),
        "tracker": _state(tracker),
    }
    models = {f"agents/{name}": agent.policy() for name, agent in agents.items()}
    return save_checkpoint(save_dir, step, models, tokenizer, state, written)


def resume_agents(cfg, agents: dict, rng: random.Random, env, tracker, metrics, parts=None) -> int:
    """The first step to run: after --load's latest loadable checkpoint (every agent's weights,
    optimizer, baseline and snapshots, the engines' weights and all random state restored, later
    metrics dropped), else 0."""
    clear_stale_of(cfg)
    latest = latest_checkpoint(cfg.checkpoint.load) if cfg.checkpoint.load else None
    if latest is None:
        metrics.archive_previous()
        return 0
    saved = sorted(p.name for p in (latest / "agents").glob("*")) if (latest / "agents").is_dir() else []
    if saved != sorted(agents):
        raise CheckpointError(f"{latest}: holds agents {saved}, this environment has {sorted(agents)}")
    models = {f"agents/{name}": agent.executor.trainer.policy for name, agent in agents.items()}
    path, state = load_latest(cfg.checkpoint.load, models)
    for name, agent in agents.items():
        mine = state["agents"][name]
        agent.executor.trainer.load_state_dict(mine["trainer"])  # Ray: the loaded weights go to the ranks too
        agent.baseline, agent.version = mine["baseline"], mine["version"]
        agent.snapshots = deque(mine["snapshots"], maxlen=agent.snapshots.maxlen)
        if mine.get("reference") is not None:  # the KL reference it was pulled to (moving or fixed)
            agent.hold_reference(mine["reference"])
        agent.push(agent.version)  # the engine takes the restored weights
    rng.setstate(state["loop_rng"])
    for obj, key in ((env, "env"), (tracker, "tracker")):
        if state[key] is not None:
            obj.load_state_dict(state[key])
    if parts is not None:  # the run parts (`miles.runtime.parts.Parts`) take theirs
        parts.load_state_dict(state)
    metrics.truncate_after(state["rollout_id"])
    log.info("resumed from %s at step %d", path, state["rollout_id"] + 1)
    return state["rollout_id"] + 1
