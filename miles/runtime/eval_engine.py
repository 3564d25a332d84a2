"""--eval-engine own: evaluation on an engine of its own, beside training.

With the default (`rollout`) the run evaluates on its rollout engines between steps, and
training waits for it. With `own`, an engine in the driver process holds a copy of the weights
taken at the evaluation step and evaluates on a thread of its own while training goes on; each
evaluation's figures are logged, under the step they evaluate, as soon as they are ready. The
copy is taken between steps, so the figures are those the rollout engines would give (the same
seeds, the same decode step), without their wait.

The engine evaluates one step at a time: a step due while the previous evaluation still runs
waits for it (evaluations slower than --eval-interval steps set the pace). A checkpoint saved
while its own step's evaluation runs records that step as pending; resuming from it evaluates
that step again unless its figures reached the metrics file before the stop.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from miles.config.schema import RunConfig
from miles.rewards.runner import RewardRunner
from miles.rollout.evaluation import EvalSet, evaluate_all
from miles.runtime.executors import local_engine
from miles.sync.strategy import InProcessBuckets

log = logging.getLogger("miles")


class OwnEvaluation:
    """An evaluation engine with its own rewards (and rollout mode): `submit` copies the
    trainer's weights into it and starts the evaluation; `ready` hands back finished ones.
    `base`: a copy of the policy as loaded, which the engine takes over."""

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

    def submit(self, trainer, rollout_id: int) -> list[tuple[int, dict[str, float]]]:
        """Evaluate the trainer's weights now (the policy after `rollout_id`; -1: before
        training); returns the evaluations that had to finish first (logged by the caller)."""
        finished = self.ready(wait=True)  # the engine takes new weights only when idle
        if self.sync is None:
            self.sync = InProcessBuckets(trainer, self.engine, self.cfg.sync.sync_bucket_size)
        self.sync.push(rollout_id + 1)
        self.running.append(
            (
                rollout_id,
                self.pool.submit(evaluate_all, self.engine, self.sets, self.cfg, self.rewards, self.mode),
            )
        )
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
