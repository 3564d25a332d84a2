"""Per-token log-probabilities and entropy from logits (or from hidden states and the LM head),
computed in row chunks.

A (tokens x 150k vocab) log-softmax is the largest tensor in RL training; chunking keeps one
chunk's worth of it alive at a time, and under autograd each chunk is recomputed in backward
(activation checkpointing) instead of stored.

The rollout engine samples from softmax(logits / temperature) and reports the log-probability
under exactly that distribution; `token_logprobs(..., temperature=T)` is the same quantity from
a full forward, so the two compare token by token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 1024


def tempered(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """fp32 logits / temperature (a number, or a tensor that broadcasts: the sampler's per row),
    always divided by a tensor on the logits' device: CUDA divides by a Python number as a
    multiply by its reciprocal, up to one ulp off true division, and the trainer's log-probs
    must have the sampler's bits (true on-policy)."""
    logits = logits.float()
    if not isinstance(temperature, torch.Tensor):
        if temperature == 1.0:
            return logits
        temperature = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    return logits / temperature


def _logprob_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(tempered(logits, temperature), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def chunked(fn, logits: torch.Tensor, *extra: torch.Tensor, chunk: int) -> torch.Tensor:
    """fn over row chunks of `logits` (..., V) and of each `extra` (..., *its own row shape),
    recomputed in backward when logits need gradients; result shape logits.shape[:-1]."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    extra = tuple(e.reshape(flat.shape[0], *e.shape[len(shape) :]) for e in extra)
    outs = []
    # split, not slicing: split's backward is one cat, a slice's is a full-size zero tensor each
    for rows in zip(flat.split(chunk), *(e.split(chunk) for e in extra)):
        if flat.requires_grad:
            outs.append(checkpoint(fn, *rows, use_reentrant=False))
        else:
            outs.append(fn(*rows))
    return torch.cat(outs).view(shape) if outs else flat.new_zeros(shape)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] for logits (..., V) and targets (...)."""
    return chunked(lambda lg, tg: _logprob_rows(lg, tg, temperature), logits, targets, chunk=chunk)


def head_logprobs(
    head,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(head(h) / temperature)[target], entropy of softmax(head(h))) for each row of
    `hidden` (N, H): the LM head and its log-softmax run one row chunk at a time, so no
    (N x vocab) logits tensor outlives its chunk (49k-150k vocabularies). A plain linear head
    takes `_LinearHead`'s closed-form backward; any other head (LoRA, fake-quantized, sharded)
    recomputes each chunk under autograd."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    if type(head) is torch.nn.Linear and head.bias is None and torch.is_grad_enabled():
        return _LinearHead.apply(hidden, head.weight, targets, temperature, chunk)

    def rows(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _head_rows(head(h).float(), t, temperature)

    logps, ents = [], []
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        logp, ent = checkpoint(rows, h, t, use_reentrant=False) if torch.is_grad_enabled() else rows(h, t)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def _head_rows(logits: torch.Tensor, targets: torch.Tensor, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """(target log-prob at `temperature`, entropy at 1) of fp32 logit rows."""
    logp, ent, _ = _head_rows_and_probs(logits, targets, temperature, probs=False)
    return logp, ent


def _head_rows_and_probs(logits: torch.Tensor, targets: torch.Tensor, temperature, probs: bool):
    """`_head_rows` and, with `probs`, softmax(logits / temperature) (else None); at temperature
    1 all three come from one log-softmax and one exp."""
    scaled = tempered(logits, temperature)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    plain = logp_all if scaled is logits else torch.log_softmax(logits, dim=-1)
    p_plain = plain.exp()
    ent = -(p_plain * plain).sum(-1)
    if not probs:
        return logp, ent, None
    return logp, ent, p_plain if scaled is logits else logp_all.exp_()


# `_LinearHead` keeps each chunk's probabilities for backward up to this many bytes in all (about
# 5k response tokens at a 49k vocabulary); above it, backward recomputes them from the hidden rows
SAVED_PROBS_BYTES = 1 << 30


class _LinearHead(torch.autograd.Function):
    """`head_logprobs` for a bias-free linear head with the gradient in closed form: per chunk,
    d logp[t] / d logits = (onehot(t) - softmax(logits / T)) / T and d entropy / d logits =
    -p (log p + H), so backward is two GEMMs on one elementwise pass instead of a replay of the
    chunk's autograd graph (the head's GEMM again, two log-softmaxes, exp, gather and their
    backwards over chunk x vocab each). The softmax of each chunk is kept for backward while
    all of them fit in `SAVED_PROBS_BYTES`; else (and when the entropy is in the loss) backward
    recomputes the chunk from its hidden rows."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        ctx.set_materialize_grads(False)  # an unused output (the logged entropy) sends None back
        keep = hidden.shape[0] * weight.shape[0] * 4 <= SAVED_PROBS_BYTES
        logps, ents, probs = [], [], []
        for h, t in zip(hidden.split(chunk), targets.split(chunk)):
            logp, ent, p = _head_rows_and_probs(F.linear(h, weight).float(), t, temperature, keep)
            logps.append(logp)
            ents.append(ent)
            probs.append(p)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk, ctx.probs = temperature, chunk, probs if keep else None
        return torch.cat(logps), torch.cat(ents)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        probs, ctx.probs = ctx.probs, None  # used once: each chunk's becomes its gradient in place
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        if grad_logp is None:
            grad_logp = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        start = 0
        for i, (h, t) in enumerate(zip(hidden.split(chunk), targets.split(chunk))):
            rows = slice(start, start + h.shape[0])
            start += h.shape[0]
            grad = None
            if probs is not None and (grad_ent is None or not grad_ent[rows].any()):
                p, probs[i] = probs[i], None
            else:
                logits = F.linear(h, weight).float()
                grad = _entropy_grad(logits, grad_ent[rows]) if grad_ent is not None else None
                p = torch.log_softmax(tempered(logits, temperature), dim=-1).exp_()
                del logits
            g = tempered(grad_logp[rows][:, None], temperature)  # upstream / T
            p.mul_(g.neg())
            p.scatter_add_(1, t[:, None], g)
            if grad is not None:
                p.add_(grad)
            p = p.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(p, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(p.t(), h)
        return grad_hidden, grad_weight, None, None, None


def _entropy_grad(logits: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor | None:
    """upstream x d entropy(softmax(logits)) / d logits = -upstream p (log p + H); None where
    nothing flows back (the entropy only logged)."""
    if not upstream.any():
        return None
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    ent = -(p * logp).sum(-1, keepdim=True)
    return p.mul_(logp.add_(ent)).mul_(-upstream[:, None])


def entropy(logits: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy -sum p log p of softmax(logits) per position, shape logits.shape[:-1]."""
    return chunked(_entropy_rows, logits, chunk=chunk)
