"""Fault injection for tests and soaks: `--fault-inject TARGET@POINT:ROLLOUT` kills one part of
a running job where a real failure would, so recovery and exact resume can be checked on purpose
instead of waited for.

TARGET: `driver` (this process, SIGKILL: a resumed run must continue as if never stopped),
`engine` (a Ray engine actor; Ray restarts it and the rollout is retried), `rank` (a Ray training
rank; the run stops with an error naming it and resumes from its checkpoint), `reward` (a reward
worker process; the call runs again on a fresh worker). POINT: `rollout` (while generating),
`step` (while training), `sync` (while pushing weights), `checkpoint` (models written, the
checkpoint not yet complete). Each fault fires once per run directory: `faults_fired.jsonl`
there records it, so a resumed run does not fire it again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.errors import ConfigError

log = logging.getLogger("miles")

TARGETS = ("driver", "engine", "rank", "reward")
POINTS = ("rollout", "step", "sync", "checkpoint")
# engines and reward workers are killed while they work: this long after the point
DELAY_S = 0.05


@dataclass(frozen=True)
class Fault:
    target: str
    point: str
    rollout: int

    @property
    def spec(self) -> str:
        return f"{self.target}@{self.point}:{self.rollout}"


def parse_fault(spec: str) -> Fault:
    """`engine@rollout:3` -> Fault; a malformed entry is refused naming the flag and the form."""
    form = f"--fault-inject {spec!r}: expected TARGET@POINT:ROLLOUT, e.g. engine@rollout:3"
    try:
        target, rest = spec.split("@", 1)
        point, rollout = rest.split(":", 1)
        fault = Fault(target.strip(), point.strip(), int(rollout))
    except ValueError:
        raise ConfigError(form) from None
    if fault.target not in TARGETS:
        raise ConfigError(f"{form}; TARGET is one of {', '.join(TARGETS)}")
    if fault.point not in POINTS:
        raise ConfigError(f"{form}; POINT is one of {', '.join(POINTS)}")
    if fault.rollout < 0:
        raise ConfigError(f"{form}; ROLLOUT is a rollout index (>= 0)")
    return fault


class FaultInjector:
    """Fires the run's faults at `reach(point, rollout_id)`; `bind` gives it the parts to kill."""

    def __init__(self, specs: list[str], run_dir: Path) -> None:
        self.faults = [parse_fault(s) for s in specs]
        self.record = Path(run_dir) / "faults_fired.jsonl"
        self.fired = self._read_fired()  # by earlier lives of this run (a killed driver restarted)
        self.trainer = self.rollout = self.rewards = None

    def bind(self, trainer: Any = None, rollout: Any = None, rewards: Any = None) -> None:
        self.trainer, self.rollout, self.rewards = trainer, rollout, rewards

    def _read_fired(self) -> set[str]:
        if not self.record.exists():
            return set()
        return {json.loads(line)["fault"] for line in self.record.read_text().splitlines() if line.strip()}

    def reach(self, point: str, rollout_id: int) -> None:
        if not self.faults:
            return
        for fault in self.faults:
            if fault.point == point and fault.rollout == rollout_id and fault.spec not in self.fired:
                self.fired.add(fault.spec)
                with self.record.open("a") as f:  # before the kill: a killed driver must not fire it again
                    f.write(json.dumps({"fault": fault.spec}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                log.warning(
                    "fault injection: killing the %s at %s of rollout %d", fault.target, point, rollout_id
                )
                kill = getattr(self, f"_kill_{fault.target}")
                if fault.target in ("engine", "reward"):  # while they work on this point's calls
                    threading.Timer(DELAY_S, kill).start()
                else:  # the driver now; a rank before its step's collectives (a peer waits on them)
                    kill()

    def _kill_driver(self) -> None:
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _kill_engine(self) -> None:
        import ray

        ray.kill(self.rollout.actors[0], no_restart=False)  # as a crash: Ray restarts it

    def _kill_rank(self) -> None:
        import ray

        ray.kill(self.trainer.ranks[-1], no_restart=True)

    def _kill_reward(self) -> None:
        workers = self.rewards.workers.workers if self.rewards.workers is not None else []
        if workers:
            workers[0].process.kill()
