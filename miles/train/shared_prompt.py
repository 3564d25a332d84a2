"""The training forward of a GRPO group computes its prompt once.

The n samples of a group share their prompt, and in a causal model the prompt's activations do
not depend on what follows, so the full forward repeats the same prompt work n times (most of
the tokens when responses are short). Here each distinct prompt runs once. Two layouts: split,
each prompt once (collecting its keys and values), then every response attending to its prompt's
keys and values; or packed, one forward in which each group is a row, its prompt then its
responses, a response attending its prompt and itself at the positions after the prompt (half
the operators; chosen where its masked attention costs little, `PACK_RATIO`). The outputs are
gathered back into the padded full-sequence layout, so everything downstream is unchanged; the
prompt's gradient sums over its group through the gather, as it does in the full forward.

Under routing replay the prompt's recorded experts must agree too (the engine prefills a group
once, so they do); samples whose prompts differ in either way are simply different prompts.
"""

from __future__ import annotations

import itertools
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
    # one row a group: its prompt, then each of its responses (`packed_forward`)
    group_ids: torch.Tensor | None = None  # (G, L)
    group_valid: torch.Tensor | None = None  # (G, L) bool
    group_positions: torch.Tensor | None = None  # (G, L)
    group_attend: torch.Tensor | None = None  # (G, L, L) bool
    group_forced: torch.Tensor | None = None  # (G, L, layers, k)
    group_gather: torch.Tensor | None = None  # (B, T-1) full-layout position -> row of the (G * L) rows

    def to(self, device) -> SharedPrompts:
        return SharedPrompts(
            *(
                None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            )
        )


# Groups run packed (`packed_forward`: one forward, each group a row) unless that computes more
# than this many times the attention scores of the two passes: a packed row's responses are
# masked from each other but their scores still computed, so long responses are cheaper split.
# (Measured on 2 CPU cores: the tiny MoE's train step 0.21 -> 0.16 s packed, at about twice the
# scores; SmolLM2's no faster at 4x.)
PACK_RATIO = 3.0


def ragged(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenated ranges [starts[i], starts[i] + counts[i]), as one index array."""
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - before, counts) + np.arange(counts.sum())


def plan_shared_prompts(
    samples: Sequence[Sample], replay_routing: bool, pack: bool = True
) -> SharedPrompts | None:
    """The shared-prompt layout of `samples`, or None when no two samples share a prompt; with
    the packed layout too where `pack` allows it and it is the cheaper (`PACK_RATIO`)."""
    B = len(samples)
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    plen = lengths - np.array([s.response_length for s in samples], dtype=np.int64)
    n_resp = lengths - 1 - plen  # response inputs: every response token but the last
    flat = np.fromiter(itertools.chain.from_iterable(s.tokens for s in samples), np.int64, int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths  # each sample's first token in `flat`
    routed = r_starts = None
    if replay_routing:  # every fed token's experts: len(tokens) - 1 rows a sample
        routed = np.concatenate([np.asarray(s.rollout_routed_experts) for s in samples]).astype(np.int64)
        r_starts = np.cumsum(lengths - 1) - (lengths - 1)
    keys: dict[bytes, int] = {}
    rows_list, firsts_list = [], []
    for b in range(B):
        key = flat[starts[b] : starts[b] + plen[b]].tobytes()
        if routed is not None:
            key += routed[r_starts[b] : r_starts[b] + plen[b]].tobytes()
        if key not in keys:
            keys[key] = len(firsts_list)
            firsts_list.append(b)
        rows_list.append(keys[key])
    if len(firsts_list) == B:
        return None
    P = len(firsts_list)
    rows, firsts = np.array(rows_list, dtype=np.int64), np.array(firsts_list, dtype=np.int64)
    prompt_lens = plen[firsts]
    S = int(prompt_lens.max())
    R = max(1, int(n_resp.max()))
    T = int((plen + n_resp).max()) + 1
    prompt_mask = np.arange(S)[None, :] < prompt_lens[:, None]
    prompt_ids = np.zeros((P, S), dtype=np.int64)
    prompt_ids[prompt_mask] = flat[ragged(starts[firsts], prompt_lens)]
    resp_mask = np.arange(R)[None, :] < n_resp[:, None]
    resp_ids = np.zeros((B, R), dtype=np.int64)
    resp_ids[resp_mask] = flat[ragged(starts + plen, n_resp)]
    resp_positions = plen[:, None] + np.arange(R)[None, :]
    # full-layout position t of row b: its prompt's row at t < p, then its response slots
    t = np.arange(T - 1)[None, :]
    in_prompt = t < plen[:, None]
    gather = np.where(in_prompt, rows[:, None] * S + t, P * S + np.arange(B)[:, None] * R + t - plen[:, None])
    gather = np.where(in_prompt | (t < (plen + n_resp)[:, None]), gather, 0)
    prompt_forced = resp_forced = None
    if routed is not None:
        n_moe, top_k = routed.shape[1:]
        prompt_forced = np.full((P, S, n_moe, top_k), -1, dtype=np.int64)
        prompt_forced[prompt_mask] = routed[ragged(r_starts[firsts], prompt_lens)]
        resp_forced = np.full((B, R, n_moe, top_k), -1, dtype=np.int64)
        resp_forced[resp_mask] = routed[ragged(r_starts + plen, n_resp)]
        prompt_forced, resp_forced = torch.from_numpy(prompt_forced), torch.from_numpy(resp_forced)
    to = torch.from_numpy
    plan = SharedPrompts(
        to(prompt_ids), to(prompt_mask), prompt_forced, to(resp_ids), to(resp_mask), to(resp_positions),
        resp_forced, to(rows), to(gather),
    )  # fmt: skip
    group_lengths = prompt_lens + np.bincount(rows, weights=n_resp, minlength=P).astype(np.int64)
    split_cost = (prompt_lens**2).sum() + (n_resp * (plen + n_resp)).sum()
    if not pack or (group_lengths**2).sum() > PACK_RATIO * split_cost:
        return plan
    # one row a group: the prompt, then its responses one after another (in sample order), each
    # attending the prompt and itself (positions restart after the prompt)
    L = int(group_lengths.max())
    order = np.argsort(rows, kind="stable")  # samples group by group
    before = np.cumsum(n_resp[order]) - n_resp[order]  # response inputs ahead of it, counted over all
    first_of_group = np.searchsorted(rows[order], np.arange(P))
    at = np.empty(B, dtype=np.int64)  # where each response starts in its group's row
    at[order] = prompt_lens[rows[order]] + before - before[first_of_group[rows[order]]]
    prompt_cells = ragged(np.arange(P) * L, prompt_lens)  # flat (P * L) cells of the prompts
    resp_cells = ragged(rows * L + at, n_resp)  # and of the responses, sample by sample
    group_ids = np.zeros(P * L, dtype=np.int64)
    group_pos = np.zeros(P * L, dtype=np.int64)
    seg = np.full(P * L, -2, dtype=np.int64)
    group_ids[prompt_cells], group_ids[resp_cells] = prompt_ids[prompt_mask], resp_ids[resp_mask]
    group_pos[prompt_cells], group_pos[resp_cells] = (
        np.arange(S)[None, :].repeat(P, 0)[prompt_mask],
        resp_positions[resp_mask],
    )
    seg[prompt_cells], seg[resp_cells] = -1, np.repeat(np.arange(B), n_resp)
    where = np.zeros(P * S + B * R, dtype=np.int64)
    where[np.flatnonzero(prompt_mask.reshape(-1))] = prompt_cells
    where[P * S + np.flatnonzero(resp_mask.reshape(-1))] = resp_cells
    group_ids, group_pos, seg = group_ids.reshape(P, L), group_pos.reshape(P, L), seg.reshape(P, L)
    valid = seg > -2
    causal = np.arange(L)[None, :, None] >= np.arange(L)[None, None, :]
    attend = causal & valid[:, None, :] & ((seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None]))
    group_forced = None
    if routed is not None:
        group_forced = torch.full((P * L, n_moe, top_k), -1, dtype=torch.long)
        group_forced[torch.from_numpy(prompt_cells)] = prompt_forced[torch.from_numpy(prompt_mask)]
        group_forced[torch.from_numpy(resp_cells)] = resp_forced[torch.from_numpy(resp_mask)]
        group_forced = group_forced.view(P, L, n_moe, top_k)
    plan.group_ids, plan.group_valid, plan.group_positions = to(group_ids), to(valid), to(group_pos)
    plan.group_attend, plan.group_forced, plan.group_gather = to(attend), group_forced, to(where[gather])
    return plan


def shared_prompt_forward(
    model: Transformer, plan: SharedPrompts, head_rows: torch.Tensor | None = None, pad_free: bool = False
) -> ModelOutput:
    """The full forward's outputs (logits, router logits, routed experts) in its padded layout,
    computed with each prompt once. `head_rows` (flat positions of the padded layout): the final
    hidden rows there, from whichever pass computed each position (a response's first target is
    predicted from its prompt's last token), in `head_rows`' order instead of logits.
    `pad_free`: both passes run their projections and MLPs on the real tokens alone. Every token
    is embedded in one call, so the embedding's backward runs once."""
    if plan.group_ids is not None:
        return packed_forward(model, plan, head_rows, pad_free)
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


def packed_forward(
    model: Transformer, plan: SharedPrompts, head_rows: torch.Tensor | None = None, pad_free: bool = False
) -> ModelOutput:
    """`shared_prompt_forward` in one forward: each group a row, its prompt then its responses,
    each response attending its prompt and itself at the positions after the prompt (the same
    arithmetic a token at a time as the two passes, in half the operators)."""
    where = plan.group_gather.reshape(-1)
    rows = None if head_rows is None else where.index_select(0, head_rows)
    out = model(
        plan.group_ids, attention_mask=plan.group_valid, positions=plan.group_positions,
        forced_experts=plan.group_forced, head_rows=rows, pad_free=pad_free, attend=plan.group_attend,
    )  # fmt: skip

    logits = _padded(out.logits, plan.group_gather) if head_rows is None else None
    compact = ModelOutput(
        logits,
        out.router_logits,
        out.routed_experts,
        head_hidden=out.head_hidden,
        routing_rows=plan.group_gather,
    )
    if plan.group_forced is not None:
        # the recorded routing is in the group layout too (`group_forced`): the router's outputs
        # stay one row a group position, each standing for the positions that map to it
        return compact
    router_logits, routed = padded_routing(compact)
    return ModelOutput(logits, router_logits, routed, head_hidden=out.head_hidden)


def padded_routing(out: ModelOutput) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(router logits per layer (B, T, E), routed experts (B, T, layers, K)) of a training forward
    in the padded layout, wherever its rows were kept compact (`ModelOutput.routing_rows`)."""
    rows = out.routing_rows
    if rows is None:
        return out.router_logits, out.routed_experts
    routed = None if out.routed_experts is None else _padded(out.routed_experts, rows)
    return [_padded(r, rows) for r in out.router_logits], routed


def _padded(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (G, L, ...) in a group layout -> (B, T, ...), position (b, t) taking row rows[b, t]
    (index_select: its backward is an index_add, much faster on CPU than advanced indexing's)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[2:])


def in_order(parts: list[torch.Tensor], picks: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose entries picks[k][j] are parts[k][j]: per-part results (each part computed
    on the positions it picked) back in the order the positions were asked in."""
    order = torch.cat(picks)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return torch.cat(parts).index_select(0, back.to(parts[0].device))
