"""The rollout feed: each step's groups, generated now or ahead, and handed to training.

Without --async-weight-sync a step's rollout runs when the step starts. With it, the next
rollout runs on a background thread while this step trains, one step off-policy (groups staler
than --max-staleness are dropped). --colocate hands the devices to the engines for the rollout
and back to the trainer after it; --partial-rollout carries unfinished groups to the next
rollout. With --rollout-mode fully-async the engines generate the next batch while this step
trains, and each version's weights land at the end of that segment (`land`;
`miles.rollout.fully_async`). A checkpoint holds what the feed carries, so a resumed run draws
exactly what the uninterrupted one would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from miles.config.schema import RunConfig
from miles.data.run_data import RunData
from miles.devices import resolve_device, yield_to_trainer
from miles.rewards.runner import RewardRunner
from miles.rollout.debug_data import load_rollout, save_rollout
from miles.rollout.fully_async import FullyAsyncRollout, staleness, trained_staleness
from miles.rollout.groups import collect_groups, score_and_filter
from miles.rollout.partial import PartialRollout
from miles.rollout.routing_buffer import RoutingBuffer
from miles.runtime.executors import Executor
from miles.runtime.train_state import carries_mode_state

log = logging.getLogger("miles")


class RolloutFeed:
    """Each step's groups and their rollout metrics (`next`), and the thread that evaluation
    shares with a rollout running ahead (`call`)."""

    def __init__(
        self,
        cfg: RunConfig,
        executor: Executor,
        data: RunData,
        rewards: RewardRunner,
        keep=None,
        mode=None,
        num_experts: int = 0,
    ) -> None:
        """`keep`: the dynamic-sampling filter; `mode`: a multi-turn rollout mode."""
        self.cfg, self.executor, self.data, self.rewards, self.keep, self.mode = (
            cfg, executor, data, rewards, keep, mode,
        )  # fmt: skip
        self.draw = cfg.rollout.over_sampling_batch_size or cfg.rollout.rollout_batch_size
        self.fully_async = FullyAsyncRollout(cfg) if cfg.sync.rollout_mode == "fully-async" else None
        # fully-async on CPU: the thread that drives the engines yields the cores to the trainer
        yields = self.fully_async is not None and resolve_device(cfg.model.device).type == "cpu"
        self.pool = (
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="miles-rollout",
                initializer=yield_to_trainer if yields else None,
            )
            if cfg.sync.async_weight_sync or self.fully_async is not None
            else None
        )
        # with --async-weight-sync: the next rollout, already running; fully-async: the next segment
        self.ahead: Future | None = None
        self.partial = PartialRollout(cfg) if cfg.rollout.partial_rollout else None
        self.routing = (  # --r3-buffer-size: routing records wait here, bounded and compact
            RoutingBuffer(cfg.algo.r3_buffer_size, num_experts)
            if cfg.algo.r3_buffer_size is not None
            else None
        )

    def _collect(self, rollout_id: int):
        # prompts are taken when the rollout starts, in order, so checkpoints know the position
        rollout, debug = self.executor.rollout, self.cfg.debug
        if debug.debug_train_only:
            return load_rollout(debug.load_debug_rollout_data, rollout_id)
        if self.partial is not None:
            groups, step = self.partial.collect(
                rollout, self.data.train.take, self.rewards, rollout_id, self.keep
            )
        else:
            items = self.data.train.take(self.draw)
            groups, step = collect_groups(
                rollout, items, self.cfg, self.rewards, rollout_id, self.keep, self.mode
            )
        if debug.save_debug_rollout_data:
            save_rollout(debug.save_debug_rollout_data, rollout_id, groups, step)
        if self.routing is not None:
            self.routing.store(s for g in groups for s in g)
        return groups, step

    def _next_fully_async(self, rollout_id: int) -> tuple[list, dict]:
        """Step `rollout_id`'s batch, once its segment has ended; the next segment starts at once,
        with the weights the engines hold (the previous step's), while this step trains."""
        fa, rollout = self.fully_async, self.executor.rollout
        self._wait_ahead()
        while fa.segment <= rollout_id:  # the first step (or a checkpoint without the segment) runs it here
            fa.run_segment(rollout, self.data.train.take)
        groups, pacing = fa.take_batch(rollout_id, self.executor.trainer.world)
        if self._more_after(rollout_id):
            self.ahead = self.pool.submit(fa.run_segment, rollout, self.data.train.take)
        if self.routing is not None:
            self.routing.store(s for g in groups for s in g)
        groups, step = score_and_filter(groups, self.cfg, self.rewards, rollout_id, self.keep)
        step.update(
            pacing, **staleness_metrics(trained_staleness(groups, rollout_id), self.cfg.sync.max_staleness)
        )
        return groups, step

    def _more_after(self, rollout_id: int) -> bool:
        """Whether to generate beyond `rollout_id`: before a later step, and after the last one of a
        run that saves (its checkpoint then holds what a longer run would carry, and extending it
        with --load and more --num-rollout is exact)."""
        return rollout_id + 1 < self.cfg.rollout.num_rollout or bool(self.cfg.checkpoint.save)

    def _wait_ahead(self) -> None:
        if self.fully_async is not None and self.ahead is not None:
            self.ahead.result()
            self.ahead = None

    def land(self, version: int, push: Callable[[int], Any]) -> Any:
        """`push(version)` to the engines: fully-async, where the segment running now ends (the
        point every run lands it at, so runs repeat and resume exactly); otherwise at once."""
        self._wait_ahead()
        return push(version)

    def next(self, rollout_id: int) -> tuple[list, dict]:
        """Rollout `rollout_id`'s groups (what training gets) and its metrics."""
        cfg, trainer, rollout = self.cfg, self.executor.trainer, self.executor.rollout
        if self.fully_async is not None:
            groups, step = self._next_fully_async(rollout_id)
        elif self.pool is not None:
            groups, step = (self.ahead or self.pool.submit(self._collect, rollout_id)).result()
            more = self._more_after(rollout_id)
            self.ahead = self.pool.submit(self._collect, rollout_id + 1) if more else None
            bound = cfg.sync.max_staleness if cfg.sync.drop_stale else None
            step["response_len_generated_mean"] = step["response_len_mean"]
            groups, step["stale_dropped"] = drop_stale(groups, rollout_id, bound)
            staleness = [s.metadata["staleness"] for g in groups for s in g]
            step.update(staleness_metrics(staleness, cfg.sync.max_staleness))
            lengths = [s.response_length for g in groups for s in g]
            step["response_len_mean"] = sum(lengths) / max(1, len(lengths))  # what trains
        elif cfg.sync.colocate:  # the engines get the devices for the rollout, the trainer after it
            offloaded = trainer.offload()
            groups, step = self._collect(rollout_id)
            step["rollout_memory_released_bytes"] = rollout.release_memory()
            step["train_offloaded_bytes"] = offloaded
            trainer.onload()
        else:
            groups, step = self._collect(rollout_id)
        if self.routing is not None:  # this step's records leave the buffer for training
            self.routing.take((s for g in groups for s in g), in_flight=self.in_flight)
            step.update(self.routing.metrics())
        if trainer.world > 1:
            groups, step["groups_dropped_for_ranks"] = fit_to_ranks(groups, trainer.world)
        step["train_samples"] = sum(len(g) for g in groups)
        step["engine_restarts"] = rollout.restarts
        return groups, step

    @property
    def in_flight(self) -> int:
        """Samples whose records may wait at once: one rollout's, two with a rollout running ahead."""
        per_rollout = self.draw * self.cfg.rollout.n_samples_per_prompt
        if self.fully_async is not None:  # admitted, not yet trained: up to --max-staleness + 1 batches
            return per_rollout * (self.cfg.sync.max_staleness + 1)
        return per_rollout * (2 if self.pool is not None else 1)

    def call(self, fn: Callable[..., Any], *args) -> Any:
        """`fn(*args)` where the engines are free: with a rollout running ahead, after it, on its
        thread (an engine serves one caller at a time)."""
        return fn(*args) if self.pool is None else self.pool.submit(fn, *args).result()

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as if never stopped: the prompt position, the rollout
        running ahead (waited for: it is the next step's, generated by the weights before this
        step's update) and the partial groups carried to the next rollout."""
        self._wait_ahead()  # fully-async: the segment running ends first (where its version lands)
        state = {"data_position": self.data.train.position}
        if self.fully_async is not None:
            state["fully_async"] = self.fully_async.state_dict()
        elif self.ahead is not None:
            state["ahead"] = self.ahead.result()
        if self.partial is not None:
            state["partial"] = self.partial.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the checkpoint's position and what it carries; what it carries and this run
        cannot use (another mode), or what this run needs and it lacks (an older checkpoint), is
        said once."""
        self.data.train.position = state["data_position"]
        for key, flag, here in (
            ("ahead", "--async-weight-sync", self.pool if self.fully_async is None else None),
            ("partial", "--partial-rollout", self.partial),
        ):
            if state.get(key) is not None and here is None:
                log.warning(
                    "the checkpoint holds %s (a %s run); this run, without %s, does not use it",
                    "a rollout generated ahead" if key == "ahead" else "partial groups carried over",
                    flag,
                    flag,
                )
            elif not carries_mode_state(state) and here is not None:
                log.warning(
                    "the checkpoint is of an older format (no %s state): the resumed %s run generates its next "
                    "rollout afresh, so it will not equal a run that was never stopped",
                    key,
                    flag,
                )
        one_ahead = self.pool is not None and self.fully_async is None
        if one_ahead and carries_mode_state(state) and state.get("ahead") is None:
            log.warning(
                "the checkpoint (rollout %d) was saved by a run without --async-weight-sync, so it holds no rollout "
                "generated ahead: this run generates the next one now, with the checkpoint's weights",
                state["rollout_id"],
            )
        if state.get("ahead") is not None and one_ahead:
            done: Future = Future()
            done.set_result(state["ahead"])
            self.ahead = done
            if self.routing is not None:
                self.routing.store(s for g in state["ahead"][0] for s in g)
        if state.get("partial") is not None and self.partial is not None:
            self.partial.load_state_dict(state["partial"])
        if self.fully_async is not None and state.get("fully_async") is not None:
            self.fully_async.load_state_dict(state["fully_async"])
        elif self.fully_async is not None:
            log.warning(
                "the checkpoint was saved by a run without --rollout-mode fully-async: the resumed run admits "
                "its first groups afresh"
            )
            self.fully_async.start_at(state["rollout_id"] + 1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def drop_stale(groups, trainer_version: int, bound: int | None):
    """Record each sample's staleness (trainer version - oldest weight version it was generated
    with) and, with a `bound` (--drop-stale), drop the groups holding a sample staler than it;
    returns (groups, dropped)."""
    kept = []
    for group in groups:
        for s in group:
            s.metadata["staleness"] = staleness(s, trainer_version)
        if bound is None or all(s.metadata["staleness"] <= bound for s in group):
            kept.append(group)
    return kept, len(groups) - len(kept)


def staleness_metrics(staleness: list[int], bound: int) -> dict[str, float]:
    """The trained samples' staleness: largest, mean, and the share at (or past) --max-staleness."""
    count = max(1, len(staleness))
    return {
        "staleness_max": max(staleness, default=0),
        "staleness_mean": sum(staleness) / count,
        "staleness_at_bound_frac": sum(x >= bound for x in staleness) / count,
    }


def fit_to_ranks(groups: list, world: int) -> tuple[list, int]:
    """Drop whole groups from the end until the samples split evenly over `world` ranks (a
    dynamic-sampling filter or the staleness bound can leave any count); returns (groups, dropped)."""
    kept = list(groups)
    while kept and sum(len(g) for g in kept) % world:
        kept.pop()
    return kept, len(groups) - len(kept)
