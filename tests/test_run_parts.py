"""Run parts: the hooks a capability gets from the RL loop, in order, with its state checkpointed,
and a part added to a run without a line of `miles/runtime/loop.py` changing."""

from __future__ import annotations

import contextlib

import pytest

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.runtime import assemble
from miles.runtime.parts import Parts, RunPart, Step
from tests.conftest import small_run_args


class Recorder(RunPart):
    """A part that does nothing but note each hook it is called at, and count its steps (its state)."""

    name = "recorder"

    def __init__(self, calls: list) -> None:
        self.calls, self.steps, self.restored = calls, 0, None

    def begin(self, start):
        self.calls.append(("begin", start))

    def before(self, step):
        self.calls.append(("before", step.rollout_id))

    @contextlib.contextmanager
    def phase(self, name, step):
        self.calls.append((f"{name}+", step.rollout_id))
        yield
        self.calls.append((f"{name}-", step.rollout_id))

    def after(self, step):
        self.steps += 1
        step.metrics["recorder_steps"] = self.steps
        self.calls.append(("after", step.rollout_id))

    def end(self):
        self.calls.append(("end", None))

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.restored = state
        self.steps = state["steps"]

    def close(self):
        self.calls.append(("close", None))


def step_calls(i: int, checkpoint: bool) -> list:
    phases = [(f"{p}{e}", i) for p in ("rollout", "train", "sync") for e in "+-"]
    return [("before", i), *phases, ("after", i)] + (
        [("checkpoint+", i), ("checkpoint-", i)] if checkpoint else []
    )


def test_a_part_added_by_its_builder_gets_every_hook_in_order_and_its_state_back(tmp_path, monkeypatch):
    """A builder appended to PART_BUILDERS (nothing else edited): the part is called begin, then
    per step before, the rollout/train/sync phases, after, the checkpoint's moment; end and close
    once. Its metric reaches metrics.jsonl; on resume its checkpointed state comes back and the
    run goes on from it."""
    parts: list[Recorder] = []
    calls: list = []

    def build(assembly):
        parts.append(Recorder(calls))
        return parts[-1]

    monkeypatch.setattr(assemble, "PART_BUILDERS", [*assemble.PART_BUILDERS, build])
    save = tmp_path / "ckpt"
    args = small_run_args(tmp_path / "run", 2) + [
        "--eval-size",
        "0",
        "--save",
        str(save),
        "--save-interval",
        "1",
    ]
    assemble.train(load_config(args))
    assert calls == [("begin", 0), *step_calls(0, True), *step_calls(1, True), ("end", None), ("close", None)]
    assert [r["recorder_steps"] for r in read_metrics(tmp_path / "run")] == [1, 2]

    (save / "latest").write_text("0")  # as if stopped after rollout 0
    calls.clear()
    assemble.train(load_config(args + ["--load", str(save)]))
    assert parts[-1].restored == {"steps": 1}
    assert calls == [("begin", 1), *step_calls(1, True), ("end", None), ("close", None)]
    assert [r["recorder_steps"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_a_failing_run_closes_every_part_and_skips_end(tmp_path, monkeypatch):
    """A part whose `after` raises stops the run with its error; `end` is not called (the run did
    not finish), `close` is, for every part, in reverse order."""
    calls: list = []

    class Broken(Recorder):
        name = "broken"

        def after(self, step):
            raise RuntimeError("part failed")

    monkeypatch.setattr(
        assemble,
        "PART_BUILDERS",
        [*assemble.PART_BUILDERS, lambda a: Recorder(calls), lambda a: Broken(calls)],
    )
    with pytest.raises(RuntimeError, match="part failed"):
        assemble.train(load_config(small_run_args(tmp_path / "run", 2) + ["--eval-size", "0"]))
    assert ("end", None) not in calls and calls[-2:] == [("close", None), ("close", None)]


def test_parts_phases_nest_in_order_and_state_is_keyed_by_name():
    calls: list = []
    a, b = Recorder(calls), Recorder(calls)
    b.name = "other"
    parts = Parts([a, b])
    step = Step(3)
    with parts.phase("train", step):
        calls.append(("inside", 3))
    assert calls == [("train+", 3), ("train+", 3), ("inside", 3), ("train-", 3), ("train-", 3)]
    a.steps, b.steps = 5, 7
    state = parts.state_dict()
    assert state == {"recorder": {"steps": 5}, "other": {"steps": 7}}
    a.steps = b.steps = 0
    parts.load_state_dict(state)
    assert (a.steps, b.steps) == (5, 7)
