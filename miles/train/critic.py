"""The PPO critic: a value model trained next to the policy on GAE returns.

The value model is the policy's network with its lm_head replaced by a scalar head (zero at
start, so the first values are 0), by default initialised from the policy's own checkpoint
(--critic-model loads another). Its value at a response position is V(state before the next
token): the same positions as the policy's log-probs, from one forward of prompt + response.

Each step (PPO): values of the step's samples from the critic as it is, GAE over the per-token
rewards (the reward on the last token, minus --kl-coef x KL to the reference where asked) gives
the advantages (whitened over the batch) and the returns; the critic then trains on the clipped
value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2), token-mean over the
global batch, accumulated exactly over micro-batches. The first --critic-warmup rollouts train the
critic only. On Ray training ranks each rank holds a replica (`miles.runtime.ray_train.RayCritic`)
and trains it data-parallel on its shard; in one process it lives next to the policy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from miles.algo import advantages as estimators
from miles.algo.losses import value_loss
from miles.config.schema import RunConfig
from miles.data.sample import Sample
from miles.models.transformer import Transformer
from miles.train.batch import forward_packed, pack_samples
from miles.train.optimizer import adamw


def value_model(policy: Transformer, critic_model: str | None, seed: int) -> Transformer:
    """The critic's network: a copy of `policy` (or the --critic-model checkpoint) with a scalar head."""
    if critic_model:
        from miles.models import registry

        model = registry.model_for(critic_model, seed=seed)
    else:
        model = copy.deepcopy(policy)
    head = nn.Linear(model.config.hidden_size, 1, bias=True)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.lm_head = head.to(next(model.parameters()).device)
    return model.train()


def token_values(
    model: Transformer, samples: Sequence[Sample], share_prompts: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (B, T-1), response mask (B, T-1)) of one forward: V at each position that predicts a
    response token (a group's shared prompt computed once, as for the policy)."""
    batch = pack_samples(samples, share_prompts=share_prompts)
    out = forward_packed(model, batch)
    return out.logits[..., 0], batch.response_mask.to(out.logits.device)


def _ragged(padded: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [row[m.bool()] for row, m in zip(padded, mask)]


def _padded(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)], mask[i, : len(r)] = r, 1.0
    return out, mask


class Critic:
    def __init__(self, model: Transformer, cfg: RunConfig, world: int = 1) -> None:
        """`world`: data-parallel ranks holding a replica, each training on its share of a batch."""
        algo, train_cfg = cfg.algo, cfg.train
        self.model, self.cfg = model, cfg
        self.lr = algo.critic_lr or train_cfg.lr
        self.optimizer = adamw(
            model.parameters(), lr=self.lr, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2)
        )
        warmup = algo.critic_lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: (step + 1) / warmup if warmup and step < warmup else 1.0
        )
        self.world = world
        self.micro = train_cfg.micro_samples(world)
        self.share = train_cfg.share_prompts
        self.grad_sync: Callable[[bool], bool] | None = None  # set by a data-parallel rank

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Each sample's per-response-token values (CPU)."""
        out = []
        for i in range(0, len(samples), self.micro):
            values, mask = token_values(self.model, samples[i : i + self.micro], self.share)
            out += [v.float().cpu() for v in _ragged(values, mask)]
        return out

    def advantages(
        self, samples: Sequence[Sample], kl: Sequence[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(advantages, returns, values) per sample, by GAE (--gamma, --lambd) on the critic's values."""
        values = self.values(samples)
        return (*gae_advantages(samples, values, self.cfg, kl), values)

    def train(
        self, samples: Sequence[Sample], returns: Sequence[torch.Tensor], old_values: Sequence[torch.Tensor]
    ) -> dict[str, float]:
        """One optimizer step on the clipped value loss over the whole batch, and its metrics."""
        return {**self.step(samples, returns, old_values), **value_stats(old_values, returns)}

    def step(
        self,
        samples: Sequence[Sample],
        returns: Sequence[torch.Tensor],
        old_values: Sequence[torch.Tensor],
        total: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch; `total`: the global batch's response
        tokens (default: these), so micro-batches and ranks add up to the exact token-mean. With
        `grad_sync` (data parallelism) the loss is scaled by the world size, which the gradient
        average undoes. value_loss and value_clipfrac are this rank's parts of the global values."""
        self.model.train()
        total = total or sum(len(r) for r in returns)
        device = next(self.model.parameters()).device
        losses, clipped = 0.0, 0.0
        for i in range(0, len(samples), self.micro):
            part = slice(i, i + self.micro)
            values, mask = token_values(self.model, samples[part], self.share)
            target = torch.zeros_like(values)
            old = torch.zeros_like(values)
            for b, (r, v) in enumerate(zip(returns[part], old_values[part])):
                where = mask[b].bool()
                target[b, where], old[b, where] = r.to(device), v.to(device)
            loss, clipfrac = value_loss(values, old, target, mask, self.cfg.algo.value_clip)
            share = float(mask.sum()) / total  # token-mean over the global batch
            (loss * share * self.world).backward()
            losses += float(loss.detach()) * share
            clipped += float(clipfrac) * share
        finite = math.isfinite(losses)
        if self.grad_sync is not None:
            finite = self.grad_sync(finite)
        clip = self.cfg.train.clip_grad
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        if finite and torch.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "value_loss": losses,
            "value_clipfrac": clipped,
            "critic_grad_norm": float(norm),
            "critic_lr": self.scheduler.get_last_lr()[0],
        }

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def gae_advantages(
    samples: Sequence[Sample],
    values: Sequence[torch.Tensor],
    cfg: RunConfig,
    kl: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(advantages, returns) per sample: GAE over the per-token rewards (the sample's reward on its
    last token, minus --kl-coef x KL where given), advantages whitened over the batch."""
    algo = cfg.algo
    padded_values, mask = _padded(values)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    token_rewards = estimators.last_token_rewards(rewards, mask)
    if kl is not None and algo.kl_coef > 0:
        token_rewards = token_rewards - algo.kl_coef * _padded(kl)[0] * mask
    adv, returns = estimators.gae(token_rewards, padded_values, mask, algo.gamma, algo.lambd)
    adv = estimators.whiten(adv, mask)  # PPO's batch normalisation of advantages
    return _ragged(adv, mask), _ragged(returns, mask)


def value_stats(values: Sequence[torch.Tensor], returns: Sequence[torch.Tensor]) -> dict[str, float]:
    flat_values, flat_returns = torch.cat(list(values)), torch.cat(list(returns))
    return {
        "values_mean": float(flat_values.mean()),
        "returns_mean": float(flat_returns.mean()),
        "explained_variance": explained_variance(flat_values, flat_returns),
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 predicts the mean, < 0 worse."""
    var = float(returns.var(unbiased=False))
    return float("nan") if var == 0 else 1.0 - float((returns - values).var(unbiased=False)) / var
