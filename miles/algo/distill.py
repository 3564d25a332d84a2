"""On-policy distillation (--use-opd): a teacher scores the policy's own samples.

The policy samples y ~ pi; the teacher's log-prob of each sampled token gives the per-token
reverse-KL estimate k1_t = log pi(y_t) - log pi_T(y_t), whose mean over samples is
KL(pi || pi_T) per token (mode-seeking: the student is pushed off tokens the teacher finds
unlikely). Two ways in:

- advantage (default): A_t <- A_t - coef * k1_t, the KL as a per-token penalty in the reward,
  with log pi taken from the engine's log-probs of the sample (no extra student forward);
- loss: coef * KL_est(pi || pi_T) added to the policy loss, with --kl-loss-type's estimator
  (the teacher is the trainer's KL reference);
- loss with --opd-topk-per-position K: per position, the exact reverse KL between the two
  distributions coarsened to K + 1 bins, the teacher's K likeliest tokens and one bin for the
  rest of the vocabulary: sum_b pi(b) (log pi(b) - log pi_T(b)). Every token of the vocabulary
  gets a gradient (through its bin), and the teacher sends only K numbers a position, so a
  teacher server (SGLang's `top_logprobs_num`) serves this form too. K = vocabulary size is
  the full reverse KL.

Either way the step logs `opd_kl`, the mean k1 over the trained tokens. The teacher is loaded
beside the trainer (--opd-teacher-load), or sits behind a server (--opd-teacher-url: SGLang or
`miles serve`; `miles.runtime.teacher` loads or calls it), which scores each sample's tokens with a prefill-only /generate request
(max_new_tokens 0, return_logprob, logprob_start_len), as slime's sglang teacher does, with
top_logprobs_num K for the top-K form.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from miles.algo.logprobs import DEFAULT_CHUNK, chunked, tempered
from miles.data.sample import Sample
from miles.errors import MilesError


def attach_topk(sample: Sample, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
    """The teacher's top-k (ids, log-probs), (response length, k), carried by the sample to the
    trainer's loss (numpy, as the sample's other per-token arrays travel)."""
    sample.teacher_topk_token_ids = ids.to(torch.int64).cpu().numpy()
    sample.teacher_topk_log_probs = logprobs.float().cpu().numpy()


def topk_of(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of softmax(logits / temperature): (ids, log-probs)."""
    logp = torch.log_softmax(tempered(logits, temperature), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return ids, values


def _tail(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(logp)) over the last dim: the log-mass outside the given tokens (floored
    at 1e-30 where they hold it all)."""
    return torch.log(torch.clamp(1.0 - logp.exp().sum(-1), min=1e-30))


def _binned_kl_rows(logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor, temperature: float):
    student = torch.log_softmax(tempered(logits, temperature), dim=-1).gather(-1, ids)
    s = torch.cat([student, _tail(student)[:, None]], dim=-1)
    t = torch.cat([teacher, _tail(teacher)[:, None]], dim=-1)
    return (s.exp() * (s - t)).sum(-1)


def topk_reverse_kl(
    logits: torch.Tensor,
    ids: torch.Tensor,
    teacher: torch.Tensor,
    temperature: float,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Per row, KL(pi || pi_T) over K + 1 bins: the teacher's top-K tokens `ids` (rows, K) with
    its log-probs `teacher`, and the rest of the vocabulary as one bin; pi = softmax(logits / T).
    Row chunks are recomputed in backward, as for the log-probs."""
    return chunked(lambda lg, i, t: _binned_kl_rows(lg, i, t, temperature), logits, ids, teacher, chunk=chunk)


def sample_topk(sample: Sample, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k the sample carries, as tensors on `device`."""
    if sample.teacher_topk_token_ids is None:
        raise MilesError("--opd-topk-per-position: a sample reached the loss without its teacher top-k")
    return (
        torch.from_numpy(np.asarray(sample.teacher_topk_token_ids)).to(device),
        torch.from_numpy(np.asarray(sample.teacher_topk_log_probs)).to(device),
    )


def reverse_kl(samples: Sequence[Sample], teacher_logprobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """k1_t = log pi(y_t) - log pi_T(y_t) on each response token (the engine's log pi)."""
    return [
        torch.tensor(s.rollout_log_probs, dtype=torch.float32) - t.float().cpu()
        for s, t in zip(samples, teacher_logprobs)
    ]


def masked_mean(values: Sequence[torch.Tensor], samples: Sequence[Sample]) -> float:
    total = count = 0.0
    for v, s in zip(values, samples):
        mask = torch.tensor(
            s.loss_mask if s.loss_mask is not None else [1] * s.response_length, dtype=torch.float32
        )
        total += float((v * mask).sum())
        count += float(mask.sum())
    return total / count if count else 0.0


def distill(
    advantages: Sequence[torch.Tensor],
    samples: Sequence[Sample],
    teacher_logprobs,
    coef: float,
    in_advantage: bool,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The advantages (with the KL penalty when `in_advantage`) and the step's opd_kl."""
    kl = reverse_kl(samples, teacher_logprobs)
    metrics = {"opd_kl": masked_mean(kl, samples)}
    if in_advantage:
        advantages = [a - coef * k.to(a.dtype) for a, k in zip(advantages, kl)]
    return list(advantages), metrics
