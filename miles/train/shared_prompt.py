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
from miles.models.transformer import ModelOutput, Prefix, Transformer


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
    routed = [_routed(s) for s in samples] if replay_routing else None
    keys: dict[bytes, int] = {}
    rows, firsts = [], []
    for b, s in enumerate(samples):
        p = s.prompt_length
        key = np.asarray(s.tokens[:p], dtype=np.int64).tobytes()
        if routed is not None:
            key += routed[b][:p].tobytes()
        if key not in keys:
            keys[key] = len(firsts)
            firsts.append(b)
        rows.append(keys[key])
    if len(firsts) == len(samples):
        return None
    B, P = len(samples), len(firsts)
    rows = np.array(rows, dtype=np.int64)
    plen = np.array([s.prompt_length for s in samples], dtype=np.int64)
    prompt_lens = plen[firsts]
    n_resp = np.array([len(s.tokens) - 1 for s in samples], dtype=np.int64) - plen  # response inputs
    S = int(prompt_lens.max())
    R = max(1, int(n_resp.max()))
    T = int((plen + n_resp).max()) + 1
    prompt_ids = np.zeros((P, S), dtype=np.int64)
    for i, b in enumerate(firsts):
        prompt_ids[i, : prompt_lens[i]] = samples[b].tokens[: prompt_lens[i]]
    prompt_mask = np.arange(S)[None, :] < prompt_lens[:, None]
    resp_ids = np.zeros((B, R), dtype=np.int64)
    for b, s in enumerate(samples):
        resp_ids[b, : n_resp[b]] = s.tokens[plen[b] : plen[b] + n_resp[b]]
    resp_mask = np.arange(R)[None, :] < n_resp[:, None]
    resp_positions = plen[:, None] + np.arange(R)[None, :]
    # full-layout position t of row b: its prompt's row at t < p, then its response slots
    t = np.arange(T - 1)[None, :]
    in_prompt = t < plen[:, None]
    gather = np.where(in_prompt, rows[:, None] * S + t, P * S + np.arange(B)[:, None] * R + t - plen[:, None])
    gather = np.where(in_prompt | (t < (plen + n_resp)[:, None]), gather, 0)
    prompt_forced = resp_forced = None
    if routed is not None:
        L, K = routed[0].shape[1:]
        prompt_forced = np.full((P, S, L, K), -1, dtype=np.int64)
        resp_forced = np.full((B, R, L, K), -1, dtype=np.int64)
        for i, b in enumerate(firsts):
            prompt_forced[i, : plen[b]] = routed[b][: plen[b]]
        for b in range(B):
            part = routed[b][plen[b] : plen[b] + n_resp[b]]
            resp_forced[b, : len(part)] = part
        prompt_forced, resp_forced = torch.from_numpy(prompt_forced), torch.from_numpy(resp_forced)
    t = torch.from_numpy
    return SharedPrompts(
        t(prompt_ids), t(prompt_mask), prompt_forced, t(resp_ids), t(resp_mask), t(resp_positions), resp_forced,
        t(rows), t(gather),
    )  # fmt: skip


def shared_prompt_forward(
    model: Transformer, plan: SharedPrompts, head_rows: torch.Tensor | None = None, pad_free: bool = False
) -> ModelOutput:
    """The full forward's outputs (logits, router logits, routed experts) in its padded layout,
    computed with each prompt once. `head_rows` (flat positions of the padded layout): the final
    hidden rows there, from whichever pass computed each position (a response's first target is
    predicted from its prompt's last token), in `head_rows`' order instead of logits.
    `pad_free`: both passes run their projections and MLPs on the real tokens alone. Every token
    is embedded in one call, so the embedding's backward runs once."""
    split = plan.prompt_ids.numel()
    first_rows = rest_rows = None
    if head_rows is not None:
        table_rows = plan.gather.reshape(-1).index_select(0, head_rows)
        in_first = table_rows < split
        first_rows, rest_rows = table_rows[in_first], table_rows[~in_first] - split
    prompt_embeds = resp_embeds = None
    embeds = model.embed_for_forwards(torch.cat([plan.prompt_ids.reshape(-1), plan.resp_ids.reshape(-1)]))
    if embeds is not None:
        prompt_embeds, resp_embeds = embeds.split([split, plan.resp_ids.numel()])
        prompt_embeds = prompt_embeds.view(*plan.prompt_ids.shape, -1)
        resp_embeds = resp_embeds.view(*plan.resp_ids.shape, -1)
    first = model(
        plan.prompt_ids,
        attention_mask=plan.prompt_mask,
        forced_experts=plan.prompt_forced,
        collect_kv=True,
        head_rows=first_rows,
        inputs_embeds=prompt_embeds,
        pad_free=pad_free,
    )
    rest = model(
        plan.resp_ids,
        attention_mask=plan.resp_mask,
        positions=plan.resp_positions,
        forced_experts=plan.resp_forced,
        prefix=Prefix(first.kv, plan.rows, plan.prompt_mask),
        head_rows=rest_rows,
        inputs_embeds=resp_embeds,
        pad_free=pad_free,
    )

    def full(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        table = torch.cat([a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:])])
        # index_select: its backward is an index_add, much faster on CPU than advanced indexing's
        return table.index_select(0, plan.gather.reshape(-1)).view(*plan.gather.shape, *a.shape[2:])

    routed = None
    if first.routed_experts is not None:
        routed = full(first.routed_experts, rest.routed_experts)
    router_logits = [full(a, b) for a, b in zip(first.router_logits, rest.router_logits)]
    if head_rows is None:
        return ModelOutput(full(first.logits, rest.logits), router_logits, routed)
    picks = [in_first.nonzero().squeeze(1), (~in_first).nonzero().squeeze(1)]
    hidden = in_order([first.head_hidden, rest.head_hidden], picks)
    return ModelOutput(None, router_logits, routed, head_hidden=hidden)


def in_order(parts: list[torch.Tensor], picks: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose entries picks[k][j] are parts[k][j]: per-part results (each part computed
    on the positions it picked) back in the order the positions were asked in."""
    order = torch.cat(picks)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return torch.cat(parts).index_select(0, back.to(parts[0].device))
