"""The training forward of a GRPO group computes its prompt once.

The n samples of a group share their prompt, and in a causal model the prompt's activations do
not depend on what follows, so the full forward repeats the same prompt work n times (most of
the tokens when responses are short). Here each distinct prompt runs once (collecting its keys
and values), then every response runs attending to its prompt's keys and values. The outputs are
gathered back into the padded full-sequence layout, so everything downstream is unchanged; the
prompt's gradient sums over its group through the gather, as it does in the full forward.

Under routing replay the prompt's recorded experts must agree too (the engine prefills a group
once, so they do); samples whose prompts differ in either way are simply different prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from miles.data.sample import Sample
from miles.models.transformer import HeadRequest, ModelOutput, Prefix, Transformer
from miles.train.length_buckets import bucketed_forward, in_order


@dataclass
class SharedPrompts:
    prompt_ids: torch.Tensor  # (P, S) right-padded distinct prompts
    prompt_mask: torch.Tensor  # (P, S) bool
    prompt_forced: torch.Tensor | None  # (P, S, layers, k)
    resp_ids: torch.Tensor  # (B, R) each sample's response inputs (all response tokens but the last)
    resp_mask: torch.Tensor  # (B, R) bool
    resp_positions: torch.Tensor  # (B, R) prompt length + offset
    resp_forced: torch.Tensor | None  # (B, R, layers, k)
    rows: torch.Tensor  # (B,) the prompt row of each sample
    gather: torch.Tensor  # (B, T-1) full-layout position -> row of cat(prompt rows, response rows)

    def to(self, device) -> SharedPrompts:
        return SharedPrompts(
            *(
                None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            )
        )


def _routed(s: Sample) -> np.ndarray:
    return np.asarray(s.rollout_routed_experts).astype(np.int64)


def plan_shared_prompts(samples: Sequence[Sample], replay_routing: bool) -> SharedPrompts | None:
    """The shared-prompt layout of `samples`, or None when no two samples share a prompt."""
    keys: dict[bytes, int] = {}
    rows, firsts = [], []
    for s in samples:
        p = s.prompt_length
        key = np.asarray(s.tokens[:p], dtype=np.int64).tobytes()
        if replay_routing:
            key += _routed(s)[:p].tobytes()
        if key not in keys:
            keys[key] = len(firsts)
            firsts.append(s)
        rows.append(keys[key])
    if len(firsts) == len(samples):
        return None
    B, P = len(samples), len(firsts)
    S = max(s.prompt_length for s in firsts)
    R = max(1, max(len(s.tokens) - 1 - s.prompt_length for s in samples))
    T = max(len(s.tokens) for s in samples)
    prompt_ids = torch.zeros(P, S, dtype=torch.long)
    prompt_mask = torch.zeros(P, S, dtype=torch.bool)
    for i, s in enumerate(firsts):
        prompt_ids[i, : s.prompt_length] = torch.tensor(s.tokens[: s.prompt_length])
        prompt_mask[i, : s.prompt_length] = True
    resp_ids = torch.zeros(B, R, dtype=torch.long)
    resp_mask = torch.zeros(B, R, dtype=torch.bool)
    resp_positions = torch.zeros(B, R, dtype=torch.long)
    gather = torch.zeros(B, T - 1, dtype=torch.long)
    for b, s in enumerate(samples):
        p, n = s.prompt_length, len(s.tokens) - 1 - s.prompt_length  # response inputs
        resp_ids[b, :n] = torch.tensor(s.tokens[p : p + n], dtype=torch.long)
        resp_mask[b, :n] = True
        resp_positions[b] = p + torch.arange(R)
        gather[b, :p] = rows[b] * S + torch.arange(p)
        gather[b, p : p + n] = P * S + b * R + torch.arange(n)
    prompt_forced = resp_forced = None
    if replay_routing:
        L, K = _routed(samples[0]).shape[1:]
        prompt_forced = torch.full((P, S, L, K), -1, dtype=torch.long)
        resp_forced = torch.full((B, R, L, K), -1, dtype=torch.long)
        for i, s in enumerate(firsts):
            prompt_forced[i, : s.prompt_length] = torch.from_numpy(_routed(s)[: s.prompt_length])
        for b, s in enumerate(samples):
            part = _routed(s)[s.prompt_length : len(s.tokens) - 1]
            resp_forced[b, : len(part)] = torch.from_numpy(part)
    return SharedPrompts(
        prompt_ids, prompt_mask, prompt_forced, resp_ids, resp_mask, resp_positions, resp_forced,
        torch.tensor(rows), gather,
    )  # fmt: skip


def shared_prompt_forward(
    model: Transformer, plan: SharedPrompts, head: HeadRequest | None = None, overhead: int | None = None
) -> ModelOutput:
    """The full forward's outputs (logits, router logits, routed experts) in its padded layout,
    computed with each prompt once. `head` (flat positions of the padded layout): the LM head
    only there, in whichever pass computed each position (a response's first target is predicted
    from its prompt's last token), and token_logprobs in `head`'s order instead of logits.
    `overhead`: run the responses in length buckets (`length_buckets`) at that price per forward."""
    split = plan.prompt_ids.numel()
    first_head = rest_head = None
    if head is not None:
        table_rows = plan.gather.reshape(-1).index_select(0, head.rows)
        in_first = table_rows < split
        first_head = head.part(in_first, table_rows[in_first])
        rest_head = head.part(~in_first, table_rows[~in_first] - split)
    first = model(
        plan.prompt_ids,
        attention_mask=plan.prompt_mask,
        forced_experts=plan.prompt_forced,
        collect_kv=True,
        head=first_head,
    )

    def responses(rows: torch.Tensor | slice, length: int, part_head: HeadRequest | None) -> ModelOutput:
        if isinstance(rows, torch.Tensor):
            rows = rows.to(plan.resp_ids.device)
        forced = None if plan.resp_forced is None else plan.resp_forced[rows, :length]
        return model(
            plan.resp_ids[rows, :length],
            attention_mask=plan.resp_mask[rows, :length],
            positions=plan.resp_positions[rows, :length],
            forced_experts=forced,
            prefix=Prefix(first.kv, plan.rows[rows], plan.prompt_mask),
            head=part_head,
        )

    width = plan.resp_ids.shape[1]
    if overhead is None:
        rest = responses(slice(None), width, rest_head)
    else:
        lengths = plan.resp_mask.sum(1).tolist()
        rest = bucketed_forward(responses, lengths, width, rest_head, overhead)

    def full(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        table = torch.cat([a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:])])
        # index_select: its backward is an index_add, much faster on CPU than advanced indexing's
        return table.index_select(0, plan.gather.reshape(-1)).view(*plan.gather.shape, *a.shape[2:])

    routed = None
    if first.routed_experts is not None:
        routed = full(first.routed_experts, rest.routed_experts)
    router_logits = [full(a, b) for a, b in zip(first.router_logits, rest.router_logits)]
    if head is None:
        return ModelOutput(full(first.logits, rest.logits), router_logits, routed)
    picks = [in_first.nonzero().squeeze(1), (~in_first).nonzero().squeeze(1)]
    logp = in_order([first.token_logprobs, rest.token_logprobs], picks)
    ent = in_order([first.token_entropy, rest.token_entropy], picks)
    return ModelOutput(None, router_logits, routed, token_logprobs=logp, token_entropy=ent)
