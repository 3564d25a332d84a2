"""Trainer-side log-probabilities of response tokens, from one full forward.

This is the quantity the rollout engine reports (`rollout_log_probs`): log softmax(logits / T)
at each response token, so the two can be compared token by token and their gap measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles.algo.logprobs import token_logprobs
from miles.data.sample import Sample
from miles.models.transformer import Transformer
from miles.train.shared_prompt import SharedPrompts, plan_shared_prompts, shared_prompt_forward


@dataclass
class PackedBatch:
    """Samples right-padded into tensors; response positions marked."""

    input_ids: torch.Tensor  # (B, T-1): every token but the last
    targets: torch.Tensor  # (B, T-1): the next token at each position
    attention_mask: torch.Tensor  # (B, T-1)
    response_mask: torch.Tensor  # (B, T-1): 1 where the target is a trained response token
    forced_experts: torch.Tensor | None  # (B, T-1, layers, k) recorded routing, -1 = none
    shared: SharedPrompts | None = None  # set: each shared prompt is computed once (see shared_prompt)

    def to(self, device) -> PackedBatch:
        return PackedBatch(
            *(None if t is None else t.to(device) for t in (self.input_ids, self.targets, self.attention_mask,
                                                              self.response_mask, self.forced_experts)),
            None if self.shared is None else self.shared.to(device),
        )  # fmt: skip


def pack_samples(
    samples: Sequence[Sample], replay_routing: bool = False, share_prompts: bool = False
) -> PackedBatch:
    T = max(len(s.tokens) for s in samples)
    B = len(samples)
    tokens = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T - 1, dtype=torch.long)
    resp = torch.zeros(B, T - 1, dtype=torch.float32)
    for b, s in enumerate(samples):
        n, p = len(s.tokens), s.prompt_length
        tokens[b, :n] = torch.tensor(s.tokens)
        attn[b, : n - 1] = 1
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        resp[b, p - 1 : n - 1] = torch.tensor(mask, dtype=torch.float32)
    if replay_routing:
        missing = [b for b, s in enumerate(samples) if s.rollout_routed_experts is None]
        if missing:
            raise ValueError(
                f"routing replay (--use-r3) needs rollout_routed_experts; sample {missing[0]} has none"
            )
    shared = plan_shared_prompts(samples, replay_routing) if share_prompts else None
    forced = None
    if replay_routing and shared is None:  # the shared-prompt plan carries its own routing
        forced = recorded_routing(samples, T - 1)
    return PackedBatch(tokens[:, :-1], tokens[:, 1:], attn, resp, forced, shared)


def recorded_routing(samples: Sequence[Sample], length: int) -> torch.Tensor:
    """The engine's recorded expert ids, right-padded: (B, length, MoE layers, k), -1 = none."""
    L, K = samples[0].rollout_routed_experts.shape[1:]
    out = torch.full((len(samples), length, L, K), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        routed = np.asarray(s.rollout_routed_experts)[:length]
        out[b, : len(routed)] = torch.from_numpy(routed.astype(np.int64))
    return out


def forward_packed(model: Transformer, batch: PackedBatch):
    """The model's output (B, T-1, ...) for a packed batch (moved to the model's device); each
    shared prompt is computed once when the batch was packed with share_prompts."""
    device = model.lm_head.weight.device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    if batch.shared is not None:
        return shared_prompt_forward(model, batch.shared)
    return model(batch.input_ids, attention_mask=batch.attention_mask, forced_experts=batch.forced_experts)


def forward_logprobs(
    model: Transformer, batch: PackedBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(logprobs (B, T-1) of each target, logits, model output) for a packed batch (moved to the
    model's device; the results stay there). `temperature`: the run's `logprob_temperature`."""
    out = forward_packed(model, batch)
    if batch.targets.device != out.logits.device:
        batch = batch.to(out.logits.device)
    return token_logprobs(out.logits, batch.targets, temperature=temperature), out.logits, out
