"""The two interfaces the RL loop drives; each is implemented in-process and on Ray.

- `Trainer`: `miles.train.policy_trainer.PolicyTrainer` (this process) and
  `miles.runtime.ray_train.RayTrainer` (data-parallel ranks).
- `Rollout`: `miles.rollout.engine.Engine` (this process) and
  `miles.runtime.ray_rollout.RolloutManager` (engine actors).

A new capability plugs in as one more class behind one of these (a speculative engine is a
`Rollout`, an expert-parallel group a `Trainer`) and one more `miles.sync.strategy` class when
its weights travel differently; the loop does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from miles.data.sample import Sample
from miles.rollout.engine import Request


class Trainer(Protocol):
    world: int  # data-parallel ranks
    policy: torch.nn.Module  # the driver's copy of the policy (checkpoints, zero-copy handles)

    def train(self, samples: Sequence[Sample], advantages: Sequence[torch.Tensor]) -> dict[str, float]: ...

    def reference_kl(self, samples: Sequence[Sample]) -> list[torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def offload(self) -> int: ...

    def onload(self) -> int: ...

    def sync_policy(self) -> None: ...

    def hf_weights(self) -> dict[str, torch.Tensor]: ...

    def share_weights(self) -> None: ...

    def weight_handles(self) -> bytes | None: ...

    def node_ids(self) -> list[str]: ...

    def peak_memory(self) -> list[dict[str, int]]: ...

    def set_precision(self, mode: str) -> None: ...


class Rollout(Protocol):
    tokenizer: object
    restarts: int  # engines restarted so far (each redid its requests)

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[Request]) -> list[Sample]: ...

    def release_memory(self) -> int: ...

    def states(self) -> list[dict[str, torch.Tensor]]: ...

    def node_ids(self) -> list[str]: ...

    def set_precision(self, mode: str) -> None: ...

    def peak_memory(self) -> list[dict[str, int]]: ...

    def update_draft(self, state: dict[str, torch.Tensor]) -> None: ...

    def take_spec_stats(self): ...  # SpecStats | None: speculative-decoding counts since the last call

    def take_times(self): ...  # EngineTimes | None: prefill and decode-step seconds since the last call

    def shutdown(self) -> None: ...
