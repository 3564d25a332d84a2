"""What a run's steps cost, as run parts: peak memory per process (`mem_*`) and the engines'
prefill/decode split of their time (`engine_*`)."""

from __future__ import annotations

import logging

import torch

from miles.devices import describe_bytes, memory_metrics, step_peak_memory
from miles.runtime.executors import Executor
from miles.runtime.parts import RunPart, Step
from miles.runtime.protocols import ReportsEngineTimes

log = logging.getLogger("miles")


class MemoryPart(RunPart):
    """Where memory goes before the first step (a training rank's weights/grads/optimizer state
    and an engine's weights by dtype), then each step's peak: this process, and the training
    ranks and engines where they have processes of their own (the largest of each)."""

    name = "memory"

    def __init__(self, executor: Executor, device: torch.device) -> None:
        self.executor, self.device = executor, device

    def begin(self, start: int) -> None:
        for role, per_process in (
            ("trainer", self.executor.trainer.peak_memory()),
            ("engine", self.executor.rollout.peak_memory()),
        ):
            if per_process:
                report = {
                    k: v for k, v in per_process[0].items() if not k.startswith(("peak_rss", "cuda_max"))
                }
                log.info("memory at start, one %s: %s", role, describe_bytes(report) or "nothing held yet")

    def after(self, step: Step) -> None:
        step.metrics.update(memory_metrics("driver", [step_peak_memory(self.device)]))
        for role, per_process in (
            ("train", self.executor.trainer.peak_memory()),
            ("rollout", self.executor.rollout.peak_memory()),
        ):
            if per_process:
                step.metrics.update(memory_metrics(role, per_process))


class EngineTimesPart(RunPart):
    """The engines' prefill and decode-step seconds of each step (`engine_*`)."""

    name = "engine_times"

    def __init__(self, rollout: ReportsEngineTimes) -> None:
        self.rollout = rollout

    def after(self, step: Step) -> None:
        times = self.rollout.take_times()
        if times is not None:
            step.metrics.update(times.metrics())
