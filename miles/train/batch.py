"""Trainer-side log-probabilities of response tokens, from one full forward.

This is the quantity the rollout engine reports (`rollout_log_probs`): log softmax(logits / T)
at each response token, so the two can be compared token by token and their gap measured. The
LM head runs on the response positions only (`head_rows`): prompt and padding positions, most
of a batch's tokens, never reach the vocabulary-sized matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles.algo.logprobs import entropy, head_logprobs, token_logprobs
from miles.data.sample import Sample
from miles.models.transformer import ModelOutput, Transformer
from miles.models.vision import batch_images
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
    response_rows: torch.Tensor | None = None  # (N,) flat positions b * (T-1) + t of every response token
    images: list | None = None  # vision-language: each row's multimodal_train_inputs (None: no image)

    def to(self, device) -> PackedBatch:
        return PackedBatch(
            *(None if t is None else t.to(device) for t in (self.input_ids, self.targets, self.attention_mask,
                                                              self.response_mask, self.forced_experts)),
            None if self.shared is None else self.shared.to(device),
            None if self.response_rows is None else self.response_rows.to(device),
            self.images,
        )  # fmt: skip


def pack_samples(
    samples: Sequence[Sample],
    replay_routing: bool = False,
    share_prompts: bool = False,
    pack_groups: bool = True,
) -> PackedBatch:
    """`samples` right-padded; with `share_prompts` each group's prompt planned once
    (`miles.train.shared_prompt`), in the packed layout where it is the cheaper and `pack_groups`
    allows it (not where ranks must agree on the number of forwards)."""
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    prompts = lengths - np.array([s.response_length for s in samples], dtype=np.int64)
    B, T = len(samples), int(lengths.max())
    tokens = np.zeros((B, T), dtype=np.int64)
    for b, s in enumerate(samples):
        tokens[b, : lengths[b]] = s.tokens
    # response positions p-1 .. n-2 of each row (the targets p .. n-1), flat in (B, T-1)
    counts = lengths - prompts
    starts = np.arange(B) * (T - 1) + prompts - 1
    rows = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    resp = np.zeros(B * (T - 1), dtype=np.float32)
    resp[rows] = np.concatenate(
        [s.loss_mask if s.loss_mask is not None else np.ones(s.response_length) for s in samples]
    )
    attn = (np.arange(T - 1)[None, :] < lengths[:, None] - 1).astype(np.int64)
    if replay_routing:
        missing = [b for b, s in enumerate(samples) if s.rollout_routed_experts is None]
        if missing:
            raise ValueError(
                f"routing replay (--use-r3) needs rollout_routed_experts; sample {missing[0]} has none"
            )
    images = [s.multimodal_train_inputs for s in samples]
    images = images if any(x is not None for x in images) else None
    # image prompts run whole: a shared prompt's keys and values would need its pixels per group
    shared = None
    if share_prompts and images is None:
        shared = plan_shared_prompts(samples, replay_routing, pack_groups)
    forced = None
    if replay_routing and shared is None:  # the shared-prompt plan carries its own routing
        forced = recorded_routing(samples, T - 1)
    tokens = torch.from_numpy(tokens)
    return PackedBatch(
        tokens[:, :-1], tokens[:, 1:], torch.from_numpy(attn), torch.from_numpy(resp).view(B, T - 1), forced,
        shared, torch.from_numpy(rows), images,
    )  # fmt: skip


def recorded_routing(samples: Sequence[Sample], length: int) -> torch.Tensor:
    """The engine's recorded expert ids, right-padded: (B, length, MoE layers, k), -1 = none."""
    L, K = samples[0].rollout_routed_experts.shape[1:]
    out = torch.full((len(samples), length, L, K), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        routed = np.asarray(s.rollout_routed_experts)[:length]
        out[b, : len(routed)] = torch.from_numpy(routed.astype(np.int64))
    return out


def forward_packed(
    model: Transformer, batch: PackedBatch, head_rows: torch.Tensor | None = None, pad_free: bool = False
) -> ModelOutput:
    """The model's output (B, T-1, ...) for a packed batch (moved to the model's device); each
    shared prompt is computed once when the batch was packed with share_prompts. `head_rows`: the
    final hidden rows at those flat (B, T-1) positions only (the output's head_hidden, no logits).
    `pad_free`: every projection and MLP runs on the real tokens alone (`Transformer.forward`)."""
    device = model.lm_head.weight.device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    if batch.shared is not None:
        return shared_prompt_forward(model, batch.shared, head_rows, pad_free)
    pixel_values, grid = None, None
    if batch.images is not None:
        pixel_values, grid = batch_images(batch.images)
        pixel_values = None if pixel_values is None else pixel_values.to(device)
    return model(
        batch.input_ids, attention_mask=batch.attention_mask, forced_experts=batch.forced_experts,
        head_rows=head_rows, pixel_values=pixel_values, image_grid_thw=grid, pad_free=pad_free,
    )  # fmt: skip


@dataclass
class TokenOutputs:
    """A packed batch's per-position results, zero outside the response positions."""

    logprobs: torch.Tensor  # (B, T-1) log softmax(logits / temperature) of each target
    entropy: torch.Tensor  # (B, T-1) entropy of softmax(logits)
    logits: torch.Tensor | None  # (B, T-1, vocab), only when asked for (top-k distillation)
    out: ModelOutput  # router logits and routed experts for MoE


def forward_logprobs(
    model: Transformer,
    batch: PackedBatch,
    temperature: float = 1.0,
    full_logits: bool = False,
    pad_free: bool = False,
) -> TokenOutputs:
    """The response tokens' log-probs and entropies for a packed batch (moved to the model's
    device; the results stay there). `temperature`: the run's `logprob_temperature`;
    `full_logits`: also every position's logits (what top-k distillation reads); `pad_free`:
    projections and MLPs on the real tokens alone (`Transformer.forward`)."""
    device = model.lm_head.weight.device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    rows = batch.response_rows
    targets = batch.targets.reshape(-1).index_select(0, rows)
    if full_logits:
        out = forward_packed(model, batch, pad_free=pad_free)
        flat = out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, rows)
        logp, ent = token_logprobs(flat, targets, temperature), entropy(flat)
    else:  # the LM head once, on every response row of every forward
        out = forward_packed(model, batch, rows, pad_free)
        logp, ent = head_logprobs(model.lm_head, out.head_hidden, targets, temperature)
    return TokenOutputs(
        scatter(logp, rows, batch.targets), scatter(ent, rows, batch.targets), out.logits, out
    )


def scatter(values: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` (N,) placed at flat `rows` of a zero tensor shaped `like` (B, T-1)."""
    flat = values.new_zeros(like.numel()).index_add(0, rows, values)  # index_add: a cheap backward
    return flat.view(like.shape)


def mean_images(images: dict) -> dict:
    """The same images with every patch replaced by its image's mean: same size and average
    colour, no content (what the blind check compares a prompt's log-probs against; the white
    images of --debug-blank-images are `miles.data.images.blank_images`)."""
    pixels, grid = (
        torch.as_tensor(images["pixel_values"]),
        torch.as_tensor(images["image_grid_thw"]).reshape(-1, 3),
    )
    parts = pixels.split(grid.prod(-1).tolist())
    return {
        "pixel_values": torch.cat([p.mean(0, keepdim=True).expand_as(p) for p in parts]),
        "image_grid_thw": grid,
    }


@torch.no_grad()
def vision_sensitivity(
    model: Transformer, samples: Sequence[Sample], temperature: float, limit: int = 4
) -> float | None:
    """Mean |log-prob change| of the response tokens of up to `limit` image samples when their
    images are blanked (`mean_images`): about 0 for a model that does not look (the images never
    reached it, or it learnt to ignore them). None without image samples."""
    picked = [s for s in samples if s.multimodal_train_inputs is not None][:limit]
    if not picked:
        return None
    blanked = [
        Sample(tokens=s.tokens, response_length=s.response_length, loss_mask=s.loss_mask,
               multimodal_train_inputs=mean_images(s.multimodal_train_inputs))
        for s in picked
    ]  # fmt: skip
    batch = pack_samples(picked)
    seen, blind = (forward_logprobs(model, b, temperature) for b in (batch, pack_samples(blanked)))
    mask = batch.response_mask.to(seen.logprobs.device)
    return float(((seen.logprobs - blind.logprobs).abs() * mask).sum() / mask.sum().clamp(min=1))
