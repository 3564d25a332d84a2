"""--warmup-precision bf16 as a run part: the FP8/INT4 layers of the trainer and the engines
compute in bf16 for the first --warmup-steps rollouts, then in FP8/INT4 (the switch is logged;
`fp8_enabled` or `int4_enabled` marks each step). A run resumed past the warm-up switches at its
first step."""

from __future__ import annotations

import logging

from miles.config.schema import RunConfig
from miles.quant.convert import low_precision, mode_at, start_mode
from miles.runtime.executors import Executor
from miles.runtime.parts import RunPart, Step
from miles.runtime.protocols import SwitchesPrecision

log = logging.getLogger("miles")


class PrecisionWarmup(RunPart):
    name = "precision"

    @staticmethod
    def applies(cfg: RunConfig) -> bool:
        """Whether the run has FP8 or INT4 layers (whose metrics this part logs, warm-up or not)."""
        return low_precision(cfg) is not None

    def __init__(self, cfg: RunConfig, executor: Executor) -> None:
        self.cfg, self.executor = cfg, executor
        self.kind = low_precision(cfg)  # fp8 | int4
        self.mode = ""  # bf16 | fp8 | int4: what the low-precision layers compute in now

    def before(self, step: Step) -> None:
        mode = mode_at(self.cfg, step.rollout_id)
        if mode != self.mode:
            if self.mode or mode != start_mode(self.cfg):
                trainer, rollout = self.executor.trainer, self.executor.rollout
                trainer.set_precision(mode)
                if isinstance(rollout, SwitchesPrecision):  # SGLang servers keep their own precision
                    rollout.set_precision(mode)
                # the engines re-quantize from the trainer's fp32 weights, not from what they held
                self.executor.sync.push(rollout.weight_version)
                log.info("rollout %d: %s layers now compute in %s", step.rollout_id, self.kind.upper(), mode)
            self.mode = mode
        step.metrics[f"{self.kind}_enabled"] = float(mode == self.kind)
