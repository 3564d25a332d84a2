"""`miles train`'s entry point: one policy (`miles.runtime.assemble`, then `miles.runtime.loop`) or, with --env-path, several
agents in a multi-agent environment (`miles.multiagent.co_evolution`)."""

from __future__ import annotations

from pathlib import Path

from miles.config.schema import RunConfig


def train(cfg: RunConfig) -> Path:
    """Run a resolved configuration; returns the run directory."""
    from miles.devices import reuse_freed_memory

    reuse_freed_memory()
    if cfg.co_evolution.env_path:
        from miles.multiagent.co_evolution import train_agents

        return train_agents(cfg)
    from miles.runtime.assemble import train as train_policy

    return train_policy(cfg)
