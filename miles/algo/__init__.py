"""miles.algo: pure torch functions for RL (advantages, losses, KL, entropy, IS corrections).

No Ray, no CLI, no model: tensors in, tensors out. Formulas are in docs/algorithms.md.
"""

from miles.algo import advantages, filters, losses, masked, mismatch
from miles.algo.logprobs import entropy, token_logprobs
from miles.algo.losses import kl_estimate, policy_loss, value_loss
from miles.algo.masked import aggregate, masked_mean, whiten
from miles.algo.mismatch import importance_weights, mismatch_metrics

__all__ = [
    "advantages",
    "aggregate",
    "entropy",
    "filters",
    "importance_weights",
    "kl_estimate",
    "losses",
    "masked",
    "masked_mean",
    "mismatch",
    "mismatch_metrics",
    "policy_loss",
    "token_logprobs",
    "value_loss",
    "whiten",
]
