"""Each sample's per-token advantages for a step's groups, by --advantage-estimator.

The formulas live in `miles.algo.advantages` (tensors in, tensors out); this applies the
configured one to samples and, for REINFORCE++, folds in the KL to the reference model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miles.algo import advantages as estimators
from miles.config.schema import RunConfig
from miles.data.sample import Sample


def compute_advantages(
    groups: Sequence[Sequence[Sample]],
    cfg: RunConfig,
    reference_kl: Callable[[list[Sample]], list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """Per-token advantages of every sample, in group order. `reference_kl`: the trainer's
    log pi - log pi_ref per token (REINFORCE++ with --kl-coef > 0)."""
    algo, group_size = cfg.algo, cfg.rollout.n_samples_per_prompt
    samples = [s for g in groups for s in g]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    lengths = [s.response_length for s in samples]
    mask = torch.tensor([[1.0] * n + [0.0] * (max(lengths) - n) for n in lengths])
    if algo.advantage_estimator in ("grpo", "gspo"):
        per_sample = estimators.grpo(
            rewards, group_size, std_normalize=not algo.disable_grpo_std_normalization
        )
    elif algo.advantage_estimator == "rloo":
        per_sample = estimators.rloo(rewards, group_size)
    else:  # reinforce_plus_plus(_baseline): per token, with the KL penalty in the reward
        kl = torch.zeros_like(mask)
        if algo.kl_coef > 0 and reference_kl is not None:
            for i, d in enumerate(reference_kl(samples)):
                kl[i, : len(d)] = d
        if algo.advantage_estimator == "reinforce_plus_plus":
            tok = estimators.reinforce_plus_plus(rewards, kl, mask, algo.kl_coef, algo.gamma)
        else:
            tok = estimators.reinforce_plus_plus_baseline(
                rewards, group_size, kl, mask, algo.kl_coef, algo.gamma
            )
        return [tok[i, :n] for i, n in enumerate(lengths)]
    if algo.normalize_advantages:
        tok = estimators.whiten(estimators.to_tokens(per_sample, mask), mask)
        return [tok[i, :n] for i, n in enumerate(lengths)]
    return [per_sample[i].expand(n) for i, n in enumerate(lengths)]
