"""`Sample`: the unit that flows from rollout to training (field names follow slime/miles)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on an EOS token or a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens or the context length
    ABORTED = "aborted"  # stopped from outside (abort, shutdown); tokens so far are kept
    FAILED = "failed"  # e.g. the reward function raised; reward is 0


@dataclass
class Sample:
    """One prompt + one response, with everything the trainer needs about how it was made.

    `tokens` is prompt + response; the response is the last `response_length` of them.
    `rollout_log_probs[i]` is the engine's log-probability of response token i (see
    docs/rollout.md for the exact distribution). `rollout_routed_experts` (MoE) has shape
    (len(tokens) - 1, MoE layers, top_k): the experts used for every token the engine fed
    through the model. `weight_versions` lists, in order, every weight version that produced
    part of this response: more than one means the response spans a weight update.
    `draft_features[i]` (with `--draft-model eagle` trained online) is the policy's final hidden
    state that response token i was sampled from, as the engine computed it.
    """

    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] | None = None
    status: Status = Status.PENDING
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: np.ndarray | None = None
    teacher_topk_token_ids: np.ndarray | None = None  # --opd-topk-per-position: (response length, k)
    teacher_topk_log_probs: np.ndarray | None = None
    weight_versions: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # the weight version of each response token
    draft_features: np.ndarray | None = (
        None  # EAGLE draft training: (response length, hidden) fp16, see below
    )
    # vision-language: the processor's outputs for the prompt's images (pixel_values, image_grid_thw),
    # from the same call that expanded its image tokens; rollout, training and checkpoints carry them
    multimodal_train_inputs: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        """Whether the task counts the response right: its reward is at least 1 (with a reward
        model's proxy score as the reward, the task's own verdict, metadata["task_reward"])."""
        return self.metadata.get("task_reward", self.reward) >= 1.0

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]
