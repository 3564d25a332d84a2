"""The RL loop: for each rollout, the parts before it, the rollout, training, the weight sync,
the parts after it, the log and the checkpoint.

`miles.runtime.assemble.train` builds a `Run` from the configuration; `run_loop` drives it
through the interfaces of `miles.runtime.protocols`, with the same calls in one process or on
Ray. What a capability adds to a step (evaluation, the online draft, precision warm-up, faults,
memory figures, the profiler, the final export) is a run part (`miles.runtime.parts`), so
adding one does not change this file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from miles.config.schema import RunConfig
from miles.devices import setup_objects_frozen
from miles.diagnostics.metrics_file import MetricsLogger
from miles.runtime.executors import Executor
from miles.runtime.feed import RolloutFeed
from miles.runtime.learner import Learner
from miles.runtime.parts import Parts, Step, due
from miles.runtime.train_state import resume, save_checkpoint

log = logging.getLogger("miles")


@dataclass
class Run:
    """Everything one `miles train` run drives."""

    cfg: RunConfig
    tokenizer: object
    executor: Executor  # the trainer, the rollout and the weight sync between them
    learner: Learner  # advantages and training (with a critic or a teacher where the run has one)
    feed: RolloutFeed  # each step's groups: generated now or ahead, scored, filtered
    parts: Parts  # what the run's capabilities add to each step
    metrics: MetricsLogger
    run_dir: Path


def run_loop(run: Run) -> Path:
    """Rollout, train, sync, log, checkpoint: `--num-rollout` times, from --load's last checkpoint."""
    start = resume_run(run)
    run.parts.begin(start)
    total = run.cfg.rollout.num_rollout
    frozen = setup_objects_frozen()  # set-up's objects are never garbage: full collections skip them
    with frozen, logging_redirect_tqdm([log]), progress_bar(run.cfg, start, total) as bar:
        for rollout_id in range(start, total):
            step = run_step(run, Step(rollout_id, last=rollout_id == total - 1))
            log_step(run, step)
            show(bar, step, run.metrics)
            if run.cfg.checkpoint.save and (step.last or due(run.cfg.checkpoint.save_interval, rollout_id)):
                save(run, step)
    run.parts.end()
    return run.run_dir


def run_step(run: Run, step: Step) -> Step:
    """One RL step: the parts' `before`, the rollout, training and the sync, the parts' `after`."""
    parts = run.parts
    parts.before(step)
    t0 = time.perf_counter()
    with parts.phase("rollout", step):
        step.groups, rollout_metrics = run.feed.next(step.rollout_id)
    step.metrics.update(rollout_metrics)
    t1 = time.perf_counter()
    if step.groups and not run.cfg.debug.debug_rollout_only:
        learn(run, step)
    t2 = time.perf_counter()
    weight_version = run.executor.rollout.weight_version
    step.metrics.update(
        rollout_time=t1 - t0, train_time=t2 - t1, step_time=t2 - t0, weight_version=weight_version
    )
    parts.after(step)
    return step


def learn(run: Run, step: Step) -> None:
    """Train on the step's groups, then (every --update-weights-interval) push the weights to the engines."""
    with run.parts.phase("train", step):
        step.metrics.update(run.learner.train(step.groups, step.rollout_id))
    rollout_id = step.rollout_id
    if not run.learner.trains_policy(rollout_id) or not due(run.cfg.sync.update_weights_interval, rollout_id):
        return
    t0 = time.perf_counter()
    with run.parts.phase("sync", step):  # fully-async: where the segment running now ends
        sync = run.feed.land(rollout_id + 1, run.executor.sync.push)
    step.metrics.update(
        sync_buckets=sync.buckets, sync_moved_bytes=sync.moved_bytes, sync_seconds=sync.seconds
    )
    if run.feed.fully_async is not None:  # how long the trainer waited for the engines' segment to end
        step.metrics["segment_wait_seconds"] = max(0.0, time.perf_counter() - t0 - sync.seconds)
    if sync.changed_fraction is not None:
        step.metrics["sync_changed_fraction"] = sync.changed_fraction
    log.debug(
        "rollout %d: weight sync v%d: %d tensors in %d buckets, %d bytes moved, %.3f s",
        rollout_id, rollout_id + 1, sync.tensors, sync.buckets, sync.moved_bytes, sync.seconds,
    )  # fmt: skip


def resume_run(run: Run) -> int:
    """The first rollout to run: after --load's latest loadable checkpoint (the learner, the
    engines' weights, the feed and every part restored), else 0."""
    start, state, checkpoint = resume(run.cfg, run.executor.trainer.policy, run.metrics)
    if checkpoint is not None:
        run.learner.load_state_dict(state, str(checkpoint))
        run.executor.sync.push(start)  # the engines take the restored weights
        run.feed.load_state_dict(state)
        run.parts.load_state_dict(state)
        log.info("resumed from %s at rollout %d", checkpoint, start)
    return start


def save(run: Run, step: Step) -> None:
    """A checkpoint after `step`: the learner's, the feed's and each part's state beside the policy.
    The parts' `checkpoint` phase falls when the models are written and the state is not yet."""
    trainer = run.executor.trainer
    trainer.sync_policy()
    state = {**run.learner.state_dict(), **run.feed.state_dict(), **run.parts.state_dict()}
    save_checkpoint(
        run.cfg.checkpoint.save, step.rollout_id, {"model": trainer.policy}, run.tokenizer, state,
        written=lambda: run.parts.mark("checkpoint", step),
    )  # fmt: skip


def log_step(run: Run, step: Step) -> None:
    metrics = step.metrics
    if log.isEnabledFor(logging.DEBUG):
        mismatch = [
            f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith(("train_rollout", "tis_", "routing_"))
        ]
        log.debug(
            "rollout %d: rollout %.2f s, train+sync %.2f s; rewards failed %d; mismatch: %s",
            step.rollout_id, metrics["rollout_time"], metrics["train_time"], metrics.get("reward_failed", 0),
            ", ".join(mismatch) or "-",
        )  # fmt: skip
    run.metrics.log(step.rollout_id, metrics)


def progress_bar(cfg: RunConfig, start: int, total: int) -> tqdm:
    return tqdm(total=total, desc="miles train", unit="step", initial=start, disable=not cfg.logging.progress)


def show(bar: tqdm, step: Step, metrics: MetricsLogger) -> None:
    """The step on the progress bar: reward, accuracy, the latest held-out accuracy, seconds."""
    m = step.metrics
    bar.update(1)
    bar.set_postfix(
        reward=f"{m['reward_mean']:.2f}", acc=f"{m['accuracy']:.2f}",
        eval=f"{metrics.latest.get('eval_accuracy', float('nan')):.2f}", s=f"{m['step_time']:.1f}",
    )  # fmt: skip
