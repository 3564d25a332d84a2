"""Preference losses on (chosen, rejected) pairs: DPO and IPO, over sequence log-probs.

With h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)), the log-ratio margin
of the chosen response y_w over the rejected y_l:

- sigmoid (DPO, Rafailov et al. 2023; TRL's `loss_type="sigmoid"`): -log sigmoid(beta h)
- ipo (Azar et al. 2023; TRL's `loss_type="ipo"`): (h - 1 / (2 beta))^2, with each sequence's
  log-prob averaged over its tokens, as TRL does for IPO

`length_normalize` averages every sequence log-prob over its tokens for DPO too (the
length-normalised variant: a longer response is not favoured for its length alone). The implicit
rewards are beta (log pi - log pi_ref) of each response, as TRL logs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """(B,) sums (or means) over each row's response tokens of (B, T) log-probs."""
    total = (token_logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def preference_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss over pairs of (B,) sequence log-probs, and TRL's metrics of the batch."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type {loss_type!r}: one of {LOSS_TYPES}")
    rewards_chosen, rewards_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": float(rewards_chosen.mean()),
        "rewards/rejected": float(rewards_rejected.mean()),
        "rewards/margins": float((rewards_chosen - rewards_rejected).mean()),
        "rewards/accuracies": float((rewards_chosen > rewards_rejected).float().mean()),
    }
    return losses.mean(), metrics
