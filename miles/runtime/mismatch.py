"""--mismatch-dump-interval as a run part: every N rollouts, before training (the generating
weights), the first --mismatch-dump-samples samples with the trainer's weights and the engine's
served ones, in <run dir>/mismatch, for `miles doctor --localize-mismatch`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from miles.config.schema import RunConfig
from miles.diagnostics.mismatch_dump import save_dump
from miles.runtime.executors import Executor
from miles.runtime.parts import RunPart, Step, due
from miles.runtime.protocols import ReadsWeightsBack


class MismatchDumpPart(RunPart):
    name = "mismatch_dump"

    def __init__(self, cfg: RunConfig, executor: Executor, run_dir: Path) -> None:
        self.cfg, self.executor, self.run_dir = cfg, executor, run_dir

    @contextmanager
    def phase(self, name: str, step: Step) -> Iterator[None]:
        if name == "train" and due(self.cfg.debug.mismatch_dump_interval, step.rollout_id):
            self.dump(step)
        yield

    def dump(self, step: Step) -> None:
        trainer, rollout = self.executor.trainer, self.executor.rollout
        trainer.sync_policy()
        engine = rollout.states()[0] if isinstance(rollout, ReadsWeightsBack) else None
        kept = step.samples[: self.cfg.debug.mismatch_dump_samples]
        save_dump(self.run_dir, step.rollout_id, kept, trainer.policy.state_dict(), engine)
