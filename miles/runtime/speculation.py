"""The speculative draft across RL steps: its metrics, its online training and its restarts.

Each step reads the engines' speculative-decoding counts (acceptance overall and by draft
position, tokens per policy pass, draft and verify seconds); with --online-sft-interval N the
draft trains every N steps on the rollouts of those N steps, and the engines get its (EMA) weights; with
--reinit-draft-interval M it is rebuilt from the current policy every M steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from miles.models.eagle import EagleHead
from miles.rollout.speculative import best_lookahead, expected_tokens_per_pass
from miles.runtime.parts import RunPart, Step
from miles.train.draft_trainer import DraftTrainer, EagleTrainer

log = logging.getLogger("miles")


class OnlineDraft(RunPart):
    """--draft-model: each step's spec_* metrics; with --online-sft-interval the draft's training,
    checkpointed under "draft"."""

    name = "draft"

    def __init__(
        self, spec_cfg, rollout, draft=None, rebuild: Callable | None = None, policy: Callable | None = None
    ) -> None:
        """`rebuild`: a fresh draft (--reinit-draft-interval); `policy`: the policy as trained so
        far, whose embedding, lm_head and hidden states an EAGLE head trains against."""
        self.cfg, self.rollout = spec_cfg, rollout
        self.trainer = None
        self.pending: list = []  # rollouts since the draft last trained
        if draft is not None and spec_cfg.online_sft_interval:
            if isinstance(draft, EagleHead):
                self.trainer = EagleTrainer(
                    draft, policy, spec_cfg.draft_lr, ema_decay=spec_cfg.draft_ema_decay, reinit=rebuild
                )
            else:
                self.trainer = DraftTrainer(draft, spec_cfg.draft_lr, spec_cfg.draft_ema_decay, rebuild)

    def after(self, step: Step) -> None:
        step.metrics.update(self.step(step.rollout_id, step.samples))

    def step(self, rollout_id: int, samples: list) -> dict[str, float]:
        stats = self.rollout.take_spec_stats()
        metrics = stats.metrics() if stats is not None else {}
        if self.cfg.profile_speculative and stats is not None and stats.rows:
            log.info("%s", profile_table(rollout_id, stats))
        cfg = self.cfg
        if self.trainer is not None:
            changed = False
            if cfg.reinit_draft_interval and (rollout_id + 1) % cfg.reinit_draft_interval == 0:
                self.trainer.reinit()
                changed = True
            self.pending += samples
            if self.pending and (rollout_id + 1) % cfg.online_sft_interval == 0:
                start = time.perf_counter()
                metrics.update(self.trainer.train(self.pending))  # every rollout since the last time
                metrics["draft_train_seconds"] = time.perf_counter() - start
                self.pending = []
                changed = True
            if changed:
                self.rollout.update_draft(
                    {k: v.detach().cpu() for k, v in self.trainer.served().state_dict().items()}
                )
        return metrics

    def state_dict(self) -> dict | None:
        """The online draft's weights, AdamW and EMA state, the rollouts it has not trained on yet
        and those it will train on again (None without online training: the draft never changes)."""
        if self.trainer is None:
            return None
        return {**_draft_state(self.trainer), "pending": self.pending, "replay": self.trainer.replay}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the draft and serve it again (the engines started from the checkpoint's draft file)."""
        if self.trainer is None:
            return
        if state is None:
            log.warning(
                "the checkpoint holds no online draft state (an older format, or a run without "
                "--online-sft-interval): the draft restarts from its file"
            )
            return
        self.trainer.model.load_state_dict(state["model"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        if self.trainer.ema is not None and state["ema"] is not None:
            self.trainer.ema.load_state_dict(state["ema"])
        self.pending = list(state["pending"])
        self.trainer.replay = [list(window) for window in state["replay"]]
        self.rollout.update_draft(
            {k: v.detach().cpu() for k, v in self.trainer.served().state_dict().items()}
        )


def _draft_state(trainer: DraftTrainer) -> dict:
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None,
    }


def profile_table(rollout_id: int, stats) -> str:
    """--profile-speculative: one step's acceptance curve, costs and the best lookahead for them."""
    a = stats.accepted / max(sum(stats.offered), 1)
    per_pass = stats.verify_seconds / max(stats.passes, 1)
    per_draft_token = stats.draft_seconds / max(stats.passes * stats.k, 1)
    lines = [
        f"speculative decoding, rollout {rollout_id}: k={stats.k}, acceptance {a:.3f}, "
        f"{stats.emitted / stats.rows:.2f} tokens per policy pass (expected {expected_tokens_per_pass(a, stats.k):.2f}), "
        f"{stats.passes} passes, draft {stats.draft_seconds:.3f} s / verify {stats.verify_seconds:.3f} s, "
        f"{stats.plain_steps} plain steps",
        "  position  acceptance",
    ]
    for i, (acc, off) in enumerate(zip(stats.at_position, stats.offered)):
        if off:
            lines.append(f"  {i + 1:8d}  {acc / off:.3f}")
    best = best_lookahead(a, per_draft_token, per_pass)
    lines.append(f"  best --spec-lookahead for this acceptance and these costs: {best}")
    return "\n".join(lines)
