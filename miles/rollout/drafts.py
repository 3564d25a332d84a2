"""Drafts for speculative decoding: who proposes the next k tokens of each running request.

- `ModelDraft`: a small causal LM with a KV cache of its own (slot for slot with the engine's).
  It remembers how many tokens of each slot its cache holds, and feeds the missing ones (a new
  prompt, the accepted tokens of the last step) before proposing, every slot in one call of
  the decode step the engine would choose for it (the fused step on a CPU).
- `NgramDraft`: continues the longest match (up to `max_n` tokens) of the context's suffix in the
  context itself or in recently finished sequences; its proposals are certain (q one-hot).
- `EagleDraft`: an `EagleHead` (`miles.models.eagle`) over the policy's final hidden state at the
  position before each request's newest token, which the engine hands it after every pass
  (`see`); it reads the engine's own embedding and lm_head, and needs no KV cache.
- `auto_draft(policy, layers)`: the policy's embedding, first `layers` blocks, final norm and
  lm_head, a copy: a draft that starts close to the policy and is cheap to run.
"""

from __future__ import annotations

import copy
import logging
from collections import deque

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.errors import ConfigError, MilesError
from miles.models.eagle import EagleHead, draft_logits, load_head
from miles.models.transformer import Transformer
from miles.rollout.sampling import draw
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


class Draft:
    """What the engine tells a draft; each draft keeps what it needs and ignores the rest."""

    kind: str
    records_features = False  # the engine keeps each response token's policy feature on its sample

    def attach(self, policy: Transformer) -> None:
        """The engine's policy (the one its weight updates go to)."""

    def reset(self, slot: int) -> None:
        """A new request takes `slot`."""

    def invalidate(self) -> None:
        """New draft weights: anything computed with the old ones is stale."""

    def keep(self, slot: int, valid: int) -> None:
        """`slot`'s sequence is valid up to `valid` tokens (the rest was rejected)."""

    def see(self, slot: int, feature: torch.Tensor) -> None:
        """The policy's final hidden state at the position before `slot`'s newest token."""

    def observe(self, tokens: list[int]) -> None:
        """A finished sequence."""


class ModelDraft(Draft):
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


class NgramDraft(Draft):
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


class EagleDraft(Draft):
    kind = "eagle"

    def __init__(self, head: EagleHead, record_features: bool = False) -> None:
        self.model = head.eval()
        self.records_features = record_features  # online training reads them off the samples
        self.features: dict[int, torch.Tensor] = {}  # slot -> its feature (see)
        self.policy: Transformer | None = None
        self._rows: tuple[tuple, torch.Tensor] | None = None  # lm_head's rows of the head's vocabulary
        self._packed: tuple[tuple, list] | None = None  # the head's products for the fused GEMM (CPU)

    def attach(self, policy: Transformer) -> None:
        self.policy = policy
        self.model.to(policy.lm_head.weight.device)

    def reset(self, slot: int) -> None:
        self.features.pop(slot, None)

    def see(self, slot: int, feature: torch.Tensor) -> None:
        self.features[slot] = feature

    def _lm_rows(self) -> torch.Tensor:
        """lm_head's rows for the head's vocabulary, gathered again only when either changes."""
        weight, vocab = self.policy.lm_head.weight, self.model.vocab
        key = (weight.data_ptr(), weight._version, vocab.data_ptr(), vocab._version)
        if self._rows is None or self._rows[0] != key:
            self._rows = key, weight.detach()[vocab.to(weight.device)]
        return self._rows[1]

    def _products(self) -> list | None:
        """fc, gate-up, down and the vocabulary's lm_head rows packed for the fused step's GEMM,
        remade when a weight changes; None off CPU/fp32 or without a compiler (torch's products
        then: at a few rows each of torch's calls costs several times its arithmetic)."""
        head, rows = self.model, self._lm_rows()
        if rows.device.type != "cpu" or rows.dtype != torch.float32:
            return None
        key = (*(p._version for p in head.parameters()), *self._rows[0])
        if self._packed is None or self._packed[0] != key:
            from miles.rollout.steps.fused import PackedLinear, compiler

            if compiler() is None:
                return None
            try:
                gate_up = torch.cat([head.mlp.gate_proj.weight, head.mlp.up_proj.weight])
                weights = [head.fc.weight, gate_up, head.mlp.down_proj.weight, rows]
                self._packed = key, [PackedLinear(w.detach()) for w in weights]
            except (RuntimeError, OSError):  # the build failed: torch's products
                return None
        return self._packed[1]

    def _step(self, embedded: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's predicted feature and its logits over the head's vocabulary."""
        head, products = self.model, self._products()
        if products is None:
            feature = head(embedded, feature)
            return feature, draft_logits(feature, self._lm_rows())
        fc, gate_up, down, lm = products
        z = fc(torch.cat([embedded, feature], -1)) + head.fc.bias
        gate, up = gate_up(head.norm(z)).chunk(2, -1)
        feature = head.out_norm(z + down(F.silu(gate) * up))
        return feature, lm(feature)

    @torch.no_grad()
    def propose(self, slots, seqs, k, temperature, top_k, top_p, generators):
        """(tokens (B, k), q (B, k, V)): k tokens per sequence, each step's predicted feature and
        sampled token the next step's input."""
        missing = [slot for slot in slots if slot not in self.features]
        if missing:
            raise MilesError(
                f"EAGLE draft: no policy feature for cache slot {missing[0]} (the engine must `see` it)"
            )
        embed, vocab = self.policy.model.embed_tokens.weight, self.model.vocab
        feature = torch.stack([self.features[slot] for slot in slots])
        token = torch.tensor([seq[-1] for seq in seqs], device=embed.device)
        tokens, qs = [], []
        for _ in range(k):
            feature, logits = self._step(embed[token], feature)
            q_draft = sampling_probs(logits[:, None], temperature, top_k, top_p)[:, 0]
            token = vocab[draw(q_draft, generators).to(vocab.device)]
            q = q_draft.new_zeros(len(slots), embed.shape[0])
            q[:, vocab] = q_draft
            tokens.append(token.cpu())
            qs.append(q)
        return torch.stack(tokens, 1), torch.stack(qs, 1)


def load_draft(spec_cfg, policy: Transformer, device) -> Transformer | None:
    """The draft model of --draft-model (None for ngram), on `device`, with the size rule checked."""
    from miles.models import registry

    if spec_cfg.draft_model == "ngram":
        return None
    if spec_cfg.draft_model == "eagle":
        if spec_cfg.eagle_head:
            return load_head(spec_cfg.eagle_head, policy).to(device)
        return EagleHead.for_policy(policy, spec_cfg.draft_vocab_size).to(device)
    if spec_cfg.draft_model == "auto":
        draft = auto_draft(policy, spec_cfg.draft_layers)
    else:
        draft = registry.model_for(spec_cfg.draft_model, flag="--draft-model")
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
    elif spec_cfg.draft_model == "eagle":
        head = draft if draft is not None else load_draft(spec_cfg, policy, policy.lm_head.weight.device)
        proposer = EagleDraft(copy.deepcopy(head), record_features=spec_cfg.online_sft_interval > 0)
    else:
        model = draft if draft is not None else load_draft(spec_cfg, policy, policy.lm_head.weight.device)
        proposer = ModelDraft(copy.deepcopy(model), slots, max_len)
    return Speculator(
        proposer,
        spec_cfg.spec_lookahead,
        spec_cfg.spec_max_batch_size,
        spec_cfg.spec_adaptive,
    )
