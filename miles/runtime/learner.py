"""One rollout of learning: advantages (GRPO-family, or PPO's critic), on-policy distillation's
teacher term, the policy's training, and the checks that stop a run that cannot go on."""

from __future__ import annotations

import torch

from miles.algo.distill import distill
from miles.config.schema import RunConfig
from miles.errors import CheckpointError, MilesError
from miles.runtime.protocols import Trainer
from miles.runtime.teacher import TeacherServer
from miles.train.sample_advantages import compute_advantages


class Learner:
    """The trainer with what the run's algorithm adds to it: a critic (--advantage-estimator ppo)
    and a teacher (--use-opd). Its checkpoint state is the trainer's ("actor") and the critic's."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, critic=None) -> None:
        """`critic`: a `miles.train.critic.Critic`, or a `RayCritic` on Ray's training ranks."""
        self.cfg, self.trainer, self.critic = cfg, trainer, critic
        algo = cfg.algo
        self.teacher = (
            TeacherServer(algo.opd_teacher_url, cfg.rollout.rollout_temperature, algo.opd_topk)
            if algo.use_opd and algo.opd_teacher_url
            else None
        )

    def train(self, groups: list, rollout_id: int) -> dict[str, float]:
        """Advantages and one rollout of training. Stops the run when training cannot go on: too
        many skipped steps, or --verify-logprobs finding trainer and engine apart."""
        reward_kl: list[float] = []

        def reference_kl(samples):  # REINFORCE++'s KL penalty, also logged as reward_kl_mean
            kl = self.trainer.reference_kl(samples)
            reward_kl.append(float(torch.cat(kl).mean()) if kl else 0.0)
            return kl

        samples = [s for g in groups for s in g]
        if self.critic is not None:
            metrics = self._train_with_critic(samples, rollout_id, reference_kl)
            if not self.trains_policy(rollout_id):
                return metrics
        else:
            advantages = compute_advantages(groups, self.cfg, reference_kl)
            opd = {}
            if self.cfg.algo.use_opd:  # the teacher's log-probs of the policy's own tokens (and its top-k)
                advantages, opd = self._distill(advantages, samples)
            metrics = {**self.trainer.train(samples, advantages), **opd}
        if reward_kl:
            metrics["reward_kl_mean"] = reward_kl[0]
        check_training(self.cfg, metrics, rollout_id)
        return metrics

    def trains_policy(self, rollout_id: int) -> bool:
        """Whether rollout `rollout_id` changes the policy (not during PPO's --critic-warmup)."""
        return self.critic is None or rollout_id >= self.cfg.algo.critic_warmup

    def _distill(self, advantages, samples):
        algo = self.cfg.algo
        teacher = (
            self.teacher.logprobs(samples)
            if self.teacher is not None
            else self.trainer.teacher_logprobs(samples, algo.opd_topk)
        )
        return distill(advantages, samples, teacher, algo.opd_kl_coef, algo.opd_type == "advantage")

    def _train_with_critic(self, samples: list, rollout_id: int, reference_kl) -> dict[str, float]:
        """PPO: GAE advantages from the critic's values (before either model changes), then the
        critic's step on the returns and, after --critic-warmup rollouts, the policy's."""
        kl = reference_kl(samples) if self.cfg.algo.kl_coef > 0 else None
        advantages, returns, values = self.critic.advantages(samples, kl)
        metrics = self.critic.train(samples, returns, values)
        if self.trains_policy(rollout_id):
            metrics.update(self.trainer.train(samples, advantages))
        return metrics

    def state_dict(self) -> dict:
        state = {"actor": self.trainer.state_dict()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict, source: str) -> None:
        """Restore the trainer (and critic) from a checkpoint's state; `source` names it in errors."""
        self.trainer.load_state_dict(state["actor"])
        if self.critic is not None:
            if "critic" not in state:
                raise CheckpointError(
                    f"{source} has no critic state: it was saved by a run without --advantage-estimator ppo"
                )
            self.critic.load_state_dict(state["critic"])


def check_training(cfg: RunConfig, metrics: dict[str, float], rollout_id: int) -> None:
    limit = cfg.train.max_consecutive_skipped_steps
    if limit and metrics.get("consecutive_skipped_steps", 0) >= limit:
        raise MilesError(
            f"{int(metrics['consecutive_skipped_steps'])} optimizer steps in a row were skipped for a non-finite loss "
            f"or gradient (rollout {rollout_id}, loss {metrics.get('loss')}): the weights or the data hold NaN/inf, "
            "or training diverged. Check the model (NaN weights?), lower --lr, or raise "
            "--max-consecutive-skipped-steps"
        )
    gap = metrics.get("train_rollout_logprob_abs_diff", 0.0)
    if cfg.algo.verify_logprobs and gap > cfg.algo.verify_logprobs_threshold:
        raise MilesError(
            f"--verify-logprobs: mean |logp_train - logp_rollout| = {gap:.4g} exceeds "
            f"{cfg.algo.verify_logprobs_threshold} at rollout {rollout_id}; try --use-r3 and --use-tis"
        )
