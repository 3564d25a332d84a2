"""Advantage estimators. Rewards come one per sample, groups contiguous (group_size each).

Outcome estimators (GRPO, Dr.GRPO, GSPO, RLOO) return one advantage per sample; use
`to_tokens` to copy it onto the response tokens. REINFORCE++ and PPO work per token.
"""

from __future__ import annotations

import torch

from miles.algo.masked import whiten

ESTIMATORS = ("grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def grpo(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std(group) + eps); without std_normalize, Dr.GRPO's r_i - mean.

    std is the unbiased sample std; a group of one has advantage 0.
    """
    g = _groups(rewards, group_size)
    adv = g - g.mean(-1, keepdim=True)
    if std_normalize and group_size > 1:
        adv = adv / (g.std(-1, keepdim=True) + eps)
    return adv.view(-1)


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean of the other samples' rewards in the group (leave-one-out)."""
    if group_size < 2:
        raise ValueError("rloo needs at least 2 samples per prompt (--n-samples-per-prompt)")
    g = _groups(rewards, group_size)
    others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return (g - others).view(-1)


def to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Copy one advantage per sample onto each of its response tokens (0 on padding)."""
    return advantages[:, None].to(mask.device).float() * mask.float()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k>=t} gamma^(k-t) r_k over the real tokens of each row."""
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t].float() + gamma * running * mask[:, t].float()
        returns[:, t] = running
    return returns * mask.float()


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) zeros with each sample's reward on its last real token."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = (mask.long().cumsum(-1) * mask.long()).argmax(-1)
    out[torch.arange(mask.shape[0]), last] = rewards.float()
    return out * mask.float()


def reinforce_plus_plus(
    rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float, gamma: float = 1.0
) -> torch.Tensor:
    """Token rewards -kl_coef*kl, outcome reward on the last token, discounted returns, whitened."""
    token_rewards = last_token_rewards(rewards, mask) - kl_coef * kl.float() * mask.float()
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_plus_plus_baseline(
    rewards: torch.Tensor,
    group_size: int,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ with the group mean subtracted from each outcome reward first."""
    baseline = grpo(rewards, group_size, std_normalize=False)
    return reinforce_plus_plus(baseline, kl, mask, kl_coef, gamma)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages, returns = advantages + values).

    delta_t = r_t + gamma V_{t+1} - V_t (V past the last real token is 0),
    A_t = delta_t + gamma lam A_{t+1}.
    """
    m = mask.float()
    values = values.float() * m
    adv = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t].float() + gamma * next_value - values[:, t]
        a = (delta + gamma * lam * next_adv) * m[:, t]
        adv[:, t] = a
        # a padding step passes the future through unchanged (right padding never has a future)
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    return adv, (adv + values) * m
