"""The interfaces the RL loop drives; each core one is implemented in-process and on Ray.

- `Trainer`: `miles.train.policy_trainer.PolicyTrainer` (this process) and
  `miles.runtime.ray_train.RayTrainer` (data-parallel ranks).
- `Rollout`: `miles.rollout.engine.Engine` (this process), `miles.runtime.ray_rollout.RolloutManager`
  (engine actors), `miles.rollout.sglang_client.SGLangRollout` (SGLang servers) and
  `miles.rollout.debug_data.ReplayRollout` (saved rollouts, no engine).

The core protocols hold what every implementation really has. What only some have is a small
capability protocol of its own (freeing memory for a colocated trainer, reading weights back,
switching precision, hosting a speculative draft, reporting engine times);
`miles.runtime.executors.check_capabilities` checks once, when the run is built, that the run's
flags ask only for capabilities its trainer and rollout have, and the loop asks `isinstance`
where a capability is optional. A new capability plugs in as one more class behind these, and
one more `miles.sync.strategy` class when its weights travel differently; the loop does not
change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from miles.data.sample import Sample
from miles.rollout.sampling import Request


class Trainer(Protocol):
    world: int  # data-parallel ranks
    policy: torch.nn.Module  # the driver's copy of the policy (checkpoints, zero-copy handles)

    def train(self, samples: Sequence[Sample], advantages: Sequence[torch.Tensor]) -> dict[str, float]: ...

    def reference_kl(self, samples: Sequence[Sample]) -> list[torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def sync_policy(self) -> None: ...

    def hf_weights(self) -> dict[str, torch.Tensor]: ...

    def node_ids(self) -> list[str]: ...

    def peak_memory(self) -> list[dict[str, int]]: ...


class Rollout(Protocol):
    tokenizer: object
    restarts: int  # engines restarted so far (each redid its requests)

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[Request]) -> list[Sample]: ...

    def node_ids(self) -> list[str]: ...

    def peak_memory(self) -> list[dict[str, int]]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class Offloads(Protocol):
    """A trainer that hands its device to colocated engines (--colocate)."""

    def offload(self) -> int: ...

    def onload(self) -> int: ...


@runtime_checkable
class SharesWeights(Protocol):
    """A trainer whose weights engines map in place (--use-zero-copy-sync)."""

    def share_weights(self) -> None: ...

    def weight_handles(self) -> bytes | None: ...


@runtime_checkable
class ReleasesMemory(Protocol):
    """A rollout that frees its KV cache for a colocated trainer (--colocate)."""

    def release_memory(self) -> int: ...


@runtime_checkable
class ReadsWeightsBack(Protocol):
    """A rollout whose served weights can be read back (--check-weight-update-equal)."""

    def states(self) -> list[dict[str, torch.Tensor]]: ...


@runtime_checkable
class SwitchesPrecision(Protocol):
    """Trainer or rollout whose FP8/INT4 layers switch between bf16 and low precision
    (--warmup-precision)."""

    def set_precision(self, mode: str) -> None: ...


@runtime_checkable
class HostsDraft(Protocol):
    """A rollout that decodes speculatively with a draft it can be sent (--draft-model)."""

    def update_draft(self, state: dict[str, torch.Tensor]) -> None: ...

    def take_spec_stats(self): ...  # SpecStats | None: speculative-decoding counts since the last call


@runtime_checkable
class ReportsEngineTimes(Protocol):
    """A rollout that splits its engines' time into prefill and decode steps (engine_* metrics)."""

    def take_times(self): ...  # EngineTimes | None: prefill and decode-step seconds since the last call
