"""Drafts for speculative decoding: who proposes the next k tokens of each running request.

- `ModelDraft`: a small causal LM with a KV cache of its own (slot for slot with the engine's).
  It remembers how many tokens of each slot its cache holds, and feeds the missing ones (a new
  prompt, the accepted tokens of the last step) before proposing, every slot in one call of
  the decode step the engine would choose for it (the fused step on a CPU).
- `NgramDraft`: continues the longest match (up to `max_n` tokens) of the context's suffix in the
  context itself or in recently finished sequences; its proposals are certain (q one-hot).
- `auto_draft(policy, layers)`: the policy's embedding, first `layers` blocks, final norm and
  lm_head, a copy: a draft that starts close to the policy and is cheap to run.
"""

from __future__ import annotations

import copy
import logging
from collections import deque

import torch
import torch.nn as nn

from miles.errors import ConfigError
from miles.models.transformer import Transformer
from miles.rollout.speculative import sampling_probs
from miles.rollout.steps import DecodeStep, choose_step

log = logging.getLogger("miles")


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def auto_draft(policy: Transformer, layers: int = 1) -> Transformer:
    """A copy of the policy cut to its first `layers` blocks."""
    if not 1 <= layers <= policy.config.num_hidden_layers:
        raise ConfigError(
            f"--draft-layers {layers}: the policy has {policy.config.num_hidden_layers} layers; use 1 to "
            f"{policy.config.num_hidden_layers - 1}"
        )
    cfg = copy.deepcopy(policy.config)
    cfg.num_hidden_layers = layers
    draft = Transformer(cfg).to(policy.lm_head.weight.device)
    state = {k: v for k, v in policy.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state, strict=False)
    return draft.eval()


class ModelDraft:
    kind = "model"

    def __init__(self, model: Transformer, slots: int, max_len: int) -> None:
        self.model = model.eval()
        self.slots, self.max_len = slots, max_len
        self.cache = model.new_cache(slots, max_len)
        self.fed: dict[int, int] = {}  # slot -> tokens of its sequence the cache holds
        self.step: DecodeStep | None = None  # chosen at first use, as the engine chooses its own

    def reset(self, slot: int) -> None:
        self.fed[slot] = 0

    def invalidate(self) -> None:
        """New draft weights: every cached key and value is stale."""
        self.fed = dict.fromkeys(self.fed, 0)

    def keep(self, slot: int, valid: int) -> None:
        self.fed[slot] = min(self.fed.get(slot, 0), valid)

    def _extend(self, slots: list[int], pieces: list[list[int]]) -> torch.Tensor:
        """Feed each slot its piece of tokens after what its cache holds, all in one call of the
        decode step (the fused step where it can run); logits (B, V) after each piece."""
        if self.step is None or not self.step.intact():
            self.step, why = choose_step(self.model)
            log.debug("draft decode step: %s", why)
        lengths = torch.tensor([len(p) for p in pieces])
        ids = torch.zeros(len(pieces), int(lengths.max()), dtype=torch.long)
        for b, piece in enumerate(pieces):
            ids[b, : len(piece)] = torch.tensor(piece)
        starts = torch.tensor([self.fed.get(slot, 0) for slot in slots])
        logits = self.step.prefill(ids, lengths, torch.tensor(slots), self.cache, starts=starts).logits[:, 0]
        for slot, piece in zip(slots, pieces):
            self.fed[slot] = self.fed.get(slot, 0) + len(piece)
        return logits

    @torch.no_grad()
    def propose(self, slots, seqs, k, temperature, top_k, top_p, generators):
        """(tokens (B, k), q (B, k, V)): k tokens per sequence sampled from the draft."""
        for slot, seq in zip(slots, seqs):  # at least the last token, whose logits propose
            self.fed[slot] = min(self.fed.get(slot, 0), len(seq) - 1)
        logits = self._extend(slots, [seq[self.fed[slot] :] for slot, seq in zip(slots, seqs)])
        tokens, qs = [], []
        for j in range(k):
            q = sampling_probs(logits[:, None], temperature, top_k, top_p)[:, 0]
            x = torch.cat([torch.multinomial(q[b].cpu(), 1, generator=g) for b, g in enumerate(generators)])
            tokens.append(x)
            qs.append(q)
            if j == k - 1:
                break
            logits = self._extend(slots, [[int(t)] for t in x])
        return torch.stack(tokens, 1), torch.stack(qs, 1)


class NgramDraft:
    kind = "ngram"

    def __init__(self, max_n: int = 4, history: int = 512) -> None:
        self.max_n = max_n
        self.recent: deque[list[int]] = deque(maxlen=history)
        self.index: dict[tuple[int, ...], tuple[list[int], int]] = {}  # n-gram -> (sequence, end)

    def observe(self, tokens: list[int]) -> None:
        """Remember a finished sequence: its n-grams point at what followed them."""
        self.recent.append(tokens)
        for n in range(1, self.max_n + 1):
            for end in range(n, len(tokens)):
                self.index[tuple(tokens[end - n : end])] = (tokens, end)

    def reset(self, slot: int) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def keep(self, slot: int, valid: int) -> None:
        pass

    def continuation(self, seq: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            suffix = seq[-n:]
            for end in range(len(seq) - 1, n - 1, -1):  # the latest earlier occurrence in the context
                if seq[end - n : end] == suffix:
                    return seq[end : end + k]
            hit = self.index.get(tuple(suffix))
            if hit is not None:
                tokens, end = hit
                return tokens[end : end + k]
        return []

    def propose(self, slots, seqs, k, temperature, top_k, top_p, generators):
        """(proposals per sequence, possibly fewer than k; q is one-hot: None)."""
        return [self.continuation(seq, k) for seq in seqs], None


def load_draft(spec_cfg, policy: Transformer, device) -> Transformer | None:
    """The draft model of --draft-model (None for ngram), on `device`, with the size rule checked."""
    from miles.models import registry

    if spec_cfg.draft_model == "ngram":
        return None
    if spec_cfg.draft_model == "auto":
        draft = auto_draft(policy, spec_cfg.draft_layers)
    else:
        draft, _ = registry.load(spec_cfg.draft_model, flag="--draft-model")
        if draft.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(
                f"--draft-model {spec_cfg.draft_model}: vocabulary of {draft.config.vocab_size} tokens, the policy's "
                f"has {policy.config.vocab_size}; a draft must share the policy's tokenizer"
            )
    draft = draft.to(device).eval()
    ours, theirs = parameter_count(draft), parameter_count(policy)
    if ours * 4 > theirs:
        log.warning(
            "--draft-model %s: %d parameters against the policy's %d (%.0f%%); a draft pays off at 1/10 to 1/4 of the "
            "policy", spec_cfg.draft_model, ours, theirs, 100 * ours / theirs,
        )  # fmt: skip
    return draft


def speculator_for(spec_cfg, policy: Transformer, slots: int, max_len: int, draft: Transformer | None = None):
    """The engine's Speculator for the run's --draft-model (None without one)."""
    from miles.rollout.speculative import Speculator

    if spec_cfg is None or spec_cfg.draft_model is None:
        return None
    if spec_cfg.draft_model == "ngram":
        proposer = NgramDraft()
    else:
        model = draft if draft is not None else load_draft(spec_cfg, policy, policy.lm_head.weight.device)
        proposer = ModelDraft(copy.deepcopy(model), slots, max_len)
    return Speculator(
        proposer,
        spec_cfg.spec_lookahead,
        spec_cfg.spec_max_batch_size,
        spec_cfg.spec_adaptive,
    )
