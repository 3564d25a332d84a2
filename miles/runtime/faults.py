"""Fault injection as a run part: each `--fault-inject TARGET@POINT:ROLLOUT` (read by
`miles.faults`) fires when the run enters that point of that rollout: the rollout, train
(POINT `step`) and sync phases, and the checkpoint's moment between its models and its state."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles.faults import parse_fault
from miles.runtime.parts import RunPart, Step

log = logging.getLogger("miles")

# engines and reward workers are killed while they work: this long after the point
DELAY_S = 0.05
POINT_OF_PHASE = {"rollout": "rollout", "train": "step", "sync": "sync", "checkpoint": "checkpoint"}


class FaultInjector(RunPart):
    """Fires the run's faults at `reach(point, rollout_id)`; `bind` gives it the parts to kill."""

    name = "faults"

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

    @contextmanager
    def phase(self, name: str, step: Step) -> Iterator[None]:
        self.reach(POINT_OF_PHASE[name], step.rollout_id)
        yield

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
                kill = {"driver": self._kill_driver, "engine": self._kill_engine, "rank": self._kill_rank,
                        "reward": self._kill_reward}[fault.target]  # fmt: skip
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
