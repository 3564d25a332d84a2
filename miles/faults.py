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

This module reads the flag; `miles.runtime.faults` fires the faults, as a run part.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.errors import ConfigError

TARGETS = ("driver", "engine", "rank", "reward")
POINTS = ("rollout", "step", "sync", "checkpoint")


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
