"""Decode steps: how the rollout engine runs the model over its KV cache.

One interface (`DecodeStep`), two implementations:

- `general`: the model's own forward (`miles.models.transformer`), the reference. It runs every
  model and option (FP8 layers, INT4 with bf16 activations, batch-invariant routing, expert capacity, sharded or
  offloaded experts, tensor parallelism) on any device: the GPU path.
- `fused`: the whole step as one C++ call (`steps/fused.cpp`), the CPU default. A row's bits do
  not depend on its batch-mates or the thread count; logits match the general forward's to fp32
  rounding.

`choose_step(model, "auto" | "fused" | "general")` picks one and says why, which the engine
reports as `decode_path` (and a run logs).
"""

from __future__ import annotations

from typing import Protocol

import torch

from miles.errors import MilesError
from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput, Transformer
from miles.models.vision import PromptVision

DECODE_STEPS = ("auto", "fused", "general")


class DecodeStep(Protocol):
    """Prefill and one-token decode over the engine's KV cache."""

    name: str

    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        starts: torch.Tensor | None = None,
        vision: PromptVision | None = None,
    ) -> ModelOutput:
        """Sequences ids (U, T), right-padded, of `lengths` tokens from position `starts` (U,)
        (default 0: prompts), into cache `slots` (U,) -> logits (U, 1, V) of each one's last
        token; routing (U, T, layers, K). From a later position, a sequence extends what its slot
        holds (a draft model catching up, or taking one token). `vision`: image prompts' pixels
        and M-RoPE positions (vision-language models)."""
        ...

    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
        rope_offsets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """ids, positions (B, T): T tokens for each of cache rows `slots` (B,) (default 0..B-1)
        -> logits (B, T, V) and routing (B, T, layers, K). T is 1 for a decode step, k + 1 for
        speculative verification. `slots` lets the tail of a rollout (a few requests left in
        high slots) cost what its rows cost. `rope_offsets` (B,): rotary positions = positions +
        offset (a vision-language row after its images)."""
        ...

    def intact(self) -> bool:
        """Whether the step still reads the model's parameters (False: build it again)."""
        ...


def choose_step(model: Transformer, kind: str = "auto") -> tuple[DecodeStep, str]:
    """The decode step for `model` as it is now, and a sentence saying which and why.

    auto: the fused step where it can run (CPU, fp32 activations, a C++ compiler, plain or INT4 projections), else
    the general forward. fused: the fused step, or an error naming what stops it."""
    from miles.rollout.steps.fused import FusedStep, fused_unsupported
    from miles.rollout.steps.general import GeneralStep

    if kind not in DECODE_STEPS:
        raise MilesError(f"--rollout-decode-step {kind!r} is not one of {list(DECODE_STEPS)}")
    if kind == "general":
        return GeneralStep(model), "general forward (asked for)"
    reason = fused_unsupported(model)
    if reason is None:
        try:
            step = FusedStep(model)
            return step, f"fused (one C++ call a step, {step.threads} threads)"
        except (RuntimeError, OSError) as error:  # no writable cache, a compiler that fails
            reason = f"its build failed ({str(error).strip()[:300]})"
    if kind == "fused":
        raise MilesError(
            f"--rollout-decode-step fused cannot run this model here: {reason}. "
            "Use --rollout-decode-step auto (or general)"
        )
    return GeneralStep(model), f"general forward (the fused step cannot run: {reason})"
