"""On-policy distillation (--use-opd): a teacher scores the policy's own samples.

The policy samples y ~ pi; the teacher's log-prob of each sampled token gives the per-token
reverse-KL estimate k1_t = log pi(y_t) - log pi_T(y_t), whose mean over samples is
KL(pi || pi_T) per token (mode-seeking: the student is pushed off tokens the teacher finds
unlikely). Two ways in:

- advantage (default): A_t <- A_t - coef * k1_t, the KL as a per-token penalty in the reward,
  with log pi taken from the engine's log-probs of the sample (no extra student forward);
- loss: coef * KL_est(pi || pi_T) added to the policy loss, with --kl-loss-type's estimator
  (the teacher is the trainer's KL reference).

Either way the step logs `opd_kl`, the mean k1 over the trained tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles.data.sample import Sample
from miles.errors import ConfigError


def load_teacher(path: str, policy: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The teacher model, frozen; its vocabulary must be the policy's (the same token ids)."""
    from miles.models import registry

    teacher, _ = registry.load(path, seed=seed)
    theirs, ours = teacher.lm_head.weight.shape[0], policy.lm_head.weight.shape[0]
    if theirs != ours:
        raise ConfigError(
            f"--opd-teacher-load {path}: its vocabulary has {theirs} tokens, the policy's {ours}; the teacher must "
            "share the policy's tokenizer"
        )
    return teacher.eval().requires_grad_(False)


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
