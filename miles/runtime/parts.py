"""Run parts: what a capability adds to the RL loop, without editing the loop.

The loop (`miles.runtime.loop`) reads as the algorithm: for each rollout, the parts' `before`,
the rollout, training, the weight sync, the parts' `after`, the log, the checkpoint. A capability
that needs a say in that (evaluation, the online draft, precision warm-up, fault injection, the
profiler, memory figures, the final export, ...) is a `RunPart` that overrides only the hooks it
needs, and is listed in `miles.runtime.assemble.PART_BUILDERS`.

A part's `name` is its key in the checkpoint (what `state_dict` returns is saved under it and
handed back to `load_state_dict` on resume) and how the run log names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

PHASES = ("rollout", "train", "sync", "checkpoint")  # what `phase` is called with


def due(interval: int, rollout_id: int) -> bool:
    """Whether an every-`interval`-rollouts action (0: never) falls after `rollout_id`."""
    return bool(interval) and (rollout_id + 1) % interval == 0


@dataclass
class Step:
    """One RL step as the parts see it: its groups once generated, and its metrics as they grow."""

    rollout_id: int
    last: bool = False  # the run's last step
    groups: list = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> list:
        return [s for g in self.groups for s in g]


class RunPart:
    """One capability's hooks into the loop; each default does nothing."""

    name = ""

    def begin(self, start: int) -> None:
        """Once, after any resume, before the first step (`start`: its rollout id; 0 for a new run)."""

    def before(self, step: Step) -> None:
        """Before the step's rollout."""

    def phase(self, name: str, step: Step) -> AbstractContextManager:
        """Around one phase of the step (one of PHASES; `checkpoint` is the moment the models are
        written and the checkpoint is not yet complete)."""
        return nullcontext()

    def after(self, step: Step) -> None:
        """After training and the sync, before the step is logged: add to `step.metrics`."""

    def end(self) -> None:
        """After the last step, when the run finished (not on an error)."""

    def state_dict(self) -> Any:
        """What a resumed run needs from this part (None: nothing)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what `state_dict` returned (None: the checkpoint holds nothing for this part)."""

    def close(self) -> None:
        """Free what the part holds; called whether or not the run finished."""


class Parts:
    """The run's parts, called in their order (closed in reverse)."""

    def __init__(self, parts: list[RunPart]) -> None:
        self.parts = list(parts)

    def begin(self, start: int) -> None:
        for part in self.parts:
            part.begin(start)

    def before(self, step: Step) -> None:
        for part in self.parts:
            part.before(step)

    @contextlib.contextmanager
    def phase(self, name: str, step: Step) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.phase(name, step))
            yield

    def mark(self, name: str, step: Step) -> None:
        """A phase with nothing in it: a point of the step the parts may act at."""
        with self.phase(name, step):
            pass

    def after(self, step: Step) -> None:
        for part in self.parts:
            part.after(step)

    def end(self) -> None:
        for part in self.parts:
            part.end()

    def state_dict(self) -> dict[str, Any]:
        return {p.name: s for p in self.parts if (s := p.state_dict()) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict(state.get(part.name))

    def close(self) -> None:
        with ExitStack() as stack:  # every part is closed, even if one raises
            for part in self.parts:
                stack.callback(part.close)
