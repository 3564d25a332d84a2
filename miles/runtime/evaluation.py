"""Held-out evaluation during a run (`miles.rollout.evaluation` evaluates; this part schedules it).

With the default `--eval-engine rollout` the run evaluates on its rollout engines between steps,
and training waits for it. With `own`, an engine in the driver process holds a copy of the weights
taken at the evaluation step and evaluates on a thread of its own while training goes on; each
evaluation's figures are logged, under the step they evaluate, as soon as they are ready. The
copy is taken between steps, so the figures are those the rollout engines would give (the same
seeds, the same decode step), without their wait.

The own engine evaluates one step at a time: a step due while the previous evaluation still runs
waits for it (evaluations slower than --eval-interval steps set the pace). A checkpoint saved
while its own step's evaluation runs records that step as pending; resuming from it evaluates
that step again unless its figures reached the metrics file before the stop.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from miles.config.schema import RunConfig
from miles.diagnostics.metrics_file import MetricsLogger
from miles.rewards.runner import RewardRunner
from miles.rollout.evaluation import EvalSet, evaluate_all
from miles.runtime.executors import local_engine
from miles.runtime.feed import RolloutFeed
from miles.runtime.parts import RunPart, Step, due
from miles.runtime.protocols import HostsDraft, Trainer
from miles.sync.strategy import InProcessBuckets

log = logging.getLogger("miles")


class OwnEngine:
    """--eval-engine own: an evaluation engine with its own rewards (and rollout mode). `submit`
    copies the trainer's weights into it and starts the evaluation; `ready` hands back finished
    ones. `base`: a copy of the policy as loaded, which the engine takes over."""

    def __init__(self, cfg: RunConfig, base: torch.nn.Module, tokenizer, max_seq_len: int,
                 sets: list[EvalSet], rewards: RewardRunner, mode=None) -> None:  # fmt: skip
        self.engine = local_engine(cfg, base, tokenizer, max_seq_len)
        self.cfg, self.sets, self.rewards, self.mode = cfg, sets, rewards, mode
        self.sync: InProcessBuckets | None = None  # built once: its staging buffer serves every copy
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="miles-eval")
        self.running: list[tuple[int, Future]] = []
        log.info(
            "evaluation on an engine of its own, beside training (decode step: %s); each evaluation is logged "
            "when ready, under the step it evaluates",
            self.engine.decode_path,
        )

    def submit(self, trainer: Trainer, rollout_id: int) -> list[tuple[int, dict[str, float]]]:
        """Evaluate the trainer's weights now (the policy after `rollout_id`; -1: before
        training); returns the evaluations that had to finish first (logged by the caller)."""
        finished = self.ready(wait=True)  # the engine takes new weights only when idle
        if self.sync is None:
            self.sync = InProcessBuckets(trainer, self.engine, self.cfg.sync.sync_bucket_size)
        self.sync.push(rollout_id + 1)
        job = self.pool.submit(evaluate_all, self.engine, self.sets, self.cfg, self.rewards, self.mode)
        self.running.append((rollout_id, job))
        return finished

    def ready(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """(step, figures) of the evaluations finished, in step order; `wait`: all of them."""
        out = []
        while self.running and (wait or self.running[0][1].done()):
            rollout_id, future = self.running.pop(0)
            out.append((rollout_id, future.result()))
        return out

    def pending(self) -> int | None:
        """The step whose evaluation still runs (None: none)."""
        return self.running[-1][0] if self.running else None

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.rewards.close()
        if self.mode is not None:
            self.mode.close()


class EvaluationPart(RunPart):
    """Evaluates before training (logged as rollout -1), every --eval-interval steps and after
    the last: on the rollout engines (`feed`'s thread), or on `own` engine."""

    name = "evaluation"

    def __init__(self, cfg: RunConfig, sets: list[EvalSet], feed: RolloutFeed, trainer: Trainer,
                 metrics: MetricsLogger, own: OwnEngine | None = None) -> None:  # fmt: skip
        self.cfg, self.sets, self.feed, self.trainer = cfg, sets, feed, trainer
        self.metrics, self.own = metrics, own
        self.resumed_pending: int | None = None  # the step a checkpoint left evaluating

    def begin(self, start: int) -> None:
        if start == 0:
            self._evaluate(-1, None)
        elif self.own is not None and (pending := self.resumed_pending) is not None:
            if not self.metrics.has(pending, "eval_"):  # stopped before that evaluation was logged
                self.own.submit(self.trainer, pending)

    def after(self, step: Step) -> None:
        if step.last or due(self.cfg.data.eval_interval, step.rollout_id):
            self._evaluate(step.rollout_id, step)
        if self.own is not None:
            self._log(self.own.ready())

    def _evaluate(self, rollout_id: int, step: Step | None) -> None:
        """Evaluate the weights after `rollout_id`; its figures join `step`'s (None: logged alone)."""
        if self.own is not None:
            self._log(self.own.submit(self.trainer, rollout_id))
            return
        rollout = self.feed.executor.rollout
        figures = self.feed.call(
            evaluate_all, rollout, self.sets, self.cfg, self.feed.rewards, self.feed.mode
        )
        if self.cfg.speculative.draft_model and isinstance(
            rollout, HostsDraft
        ):  # the spec_* metrics of a step count its own rollout only
            rollout.take_spec_stats()
        if step is None:
            self.metrics.log(rollout_id, figures)
        else:
            step.metrics.update(figures)

    def _log(self, finished: list[tuple[int, dict[str, float]]]) -> None:
        for rollout_id, figures in finished:
            self.metrics.log(rollout_id, figures)

    def end(self) -> None:
        if self.own is not None:  # the run ends with its last evaluation logged
            self._log(self.own.ready(wait=True))

    def state_dict(self) -> dict | None:
        return {"pending": self.own.pending()} if self.own is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        self.resumed_pending = state["pending"] if state else None

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
