"""The EAGLE draft head: one small block over the policy's last hidden state and the next token.

The policy's logits at position t are lm_head(f_t), f_t its final-normed hidden state. The head
takes f_t and the token x_{t+1} sampled from those logits and predicts f_{t+1}:

    z = fc([embed(x_{t+1}), f_t]);  z = z + mlp(norm(z));  h = out_norm(z) ~ f_{t+1}

so lm_head(h) proposes x_{t+2}, and (h, x_{t+2}) proposes the token after. Embedding and lm_head
are the policy's own (read, never trained or copied: the head's state is its ~2.5% of the
policy's parameters). lm_head is read on the `vocab` rows only, the tokens the policy samples
most often: a draft that reads all of a large vocabulary would cost a fifth of a policy pass per
token (EAGLE-3 and FR-Spec shrink the draft's vocabulary the same way). `counts` keeps how often
each token was sampled in the rollouts the head trained on; `choose_vocab` ranks by them.

`save_head` / `load_head`: a head trained before a run (`miles draft`) and started from with
--eagle-head, so speculation pays from the first rollout instead of after online training.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.errors import ConfigError
from miles.models.linear import default_linear
from miles.models.transformer import MLP, RMSNorm, Transformer


class EagleHead(nn.Module):
    def __init__(self, hidden: int, inner: int, vocab: int, draft_vocab: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, inner, "mlp", default_linear)
        self.out_norm = RMSNorm(hidden, eps)
        size = vocab if draft_vocab <= 0 else min(draft_vocab, vocab)
        # before any counts, the lowest ids: byte-level BPE numbers its merges roughly by frequency
        self.register_buffer("vocab", torch.arange(size))
        self.register_buffer("counts", torch.zeros(vocab, dtype=torch.long))

    @classmethod
    def for_policy(cls, policy: Transformer, draft_vocab: int, seed: int = 0) -> EagleHead:
        """A head sized for `policy`, its weights drawn from `seed` (every process builds the same)."""
        cfg = policy.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, draft_vocab, cfg.rms_norm_eps)
        with torch.no_grad():  # the target f_{t+1} is scaled by the policy's final norm: start there
            head.out_norm.weight.copy_(policy.model.norm.weight.detach())
        return head.to(policy.lm_head.weight.device)

    def forward(self, embedded: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """(..., hidden) token embeddings and policy features -> the predicted next feature."""
        z = self.fc(torch.cat([embedded, feature], -1))
        z = z + self.mlp(self.norm(z))
        return self.out_norm(z)

    def count(self, tokens: torch.Tensor) -> None:
        """Add sampled tokens to the counts the vocabulary is chosen by."""
        self.counts += torch.bincount(
            tokens.reshape(-1).to(self.counts.device), minlength=self.counts.numel()
        )

    def choose_vocab(self) -> None:
        """The most sampled tokens (ties: lower id first) become the head's vocabulary."""
        order = torch.argsort(-self.counts, stable=True)
        self.vocab.copy_(order[: self.vocab.numel()].sort().values)


def draft_logits(h: torch.Tensor, lm_head_rows: torch.Tensor) -> torch.Tensor:
    """Logits over the head's vocabulary: h (..., hidden) against lm_head's rows for it (V', hidden)."""
    return F.linear(h, lm_head_rows).float()


HEAD_FORMAT = "miles-eagle-head-1"


def save_head(head: EagleHead, path: str | Path, policy: str) -> None:
    """Write `head` (trained for the policy named `policy`) where --eagle-head can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    torch.save({"format": HEAD_FORMAT, "policy": policy, "state": state}, path)


def load_head(path: str | Path, policy: Transformer, flag: str = "--eagle-head") -> EagleHead:
    """The head saved at `path`, for `policy` (its sizes checked against the policy's)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file; write one with `miles draft --out {path}`")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file
        raise ConfigError(f"{flag} {path}: not a saved EAGLE head ({error})") from error
    if not isinstance(saved, dict) or saved.get("format") != HEAD_FORMAT:
        raise ConfigError(f"{flag} {path}: not a head written by `miles draft` (format {HEAD_FORMAT})")
    state, cfg = saved["state"], policy.config
    hidden, vocab = state["fc.weight"].shape[0], state["counts"].shape[0]
    if (hidden, vocab) != (cfg.hidden_size, cfg.vocab_size):
        raise ConfigError(
            f"{flag} {path}: a head for {saved['policy']} (hidden {hidden}, vocabulary {vocab}); this policy has "
            f"hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}. Train one for it with `miles draft`"
        )
    head = EagleHead.for_policy(policy, draft_vocab=state["vocab"].shape[0])
    head.load_state_dict(state)
    return head
