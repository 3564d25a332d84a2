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
    `hidden` (N, H): the LM head and its log-softmax run one row chunk at a time, recomputed in
    backward, so no (N x vocab) logits tensor outlives its chunk (49k-150k vocabularies)."""

    def rows(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h).float()
        return _logprob_rows(logits, t, temperature), _entropy_rows(logits)

    logps, ents = [], []
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        logp, ent = checkpoint(rows, h, t, use_reentrant=False) if torch.is_grad_enabled() else rows(h, t)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def entropy(logits: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy -sum p log p of softmax(logits) per position, shape logits.shape[:-1]."""
    return chunked(_entropy_rows, logits, chunk=chunk)
