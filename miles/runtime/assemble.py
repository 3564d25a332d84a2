"""Building a `miles train` run from its configuration: the model, data and rewards, the
trainer / rollout / weight-sync trio (`miles.runtime.executors`), the learner, the rollout feed
and the run parts; then `miles.runtime.loop.run_loop` drives it.

A new capability that needs the loop is a `RunPart` and one builder in `PART_BUILDERS`: a
function of the `Assembly` that returns the part, or None when the run does not use it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.agents.modes import RolloutMode, rollout_mode
from miles.algo.filters import nonconstant_reward
from miles.config import to_dict
from miles.config.schema import RunConfig
from miles.data.run_data import RunData, build_data
from miles.devices import resolve_device
from miles.diagnostics.metrics_file import MetricsLogger
from miles.errors import ConfigError, MilesError
from miles.models import registry
from miles.rewards.functions import load_function
from miles.rewards.runner import RewardRunner
from miles.rollout.drafts import load_draft
from miles.rollout.evaluation import EvalSet, eval_sets_of
from miles.rollout.kv_budget import check_weights_fit
from miles.runtime.evaluation import EvaluationPart, OwnEngine
from miles.runtime.executors import Executor, build_executor, on_ray
from miles.runtime.export import ExportPart
from miles.runtime.faults import FaultInjector
from miles.runtime.feed import RolloutFeed
from miles.runtime.learner import Learner
from miles.runtime.loop import Run, run_loop
from miles.runtime.metrics import run_dir_for
from miles.runtime.mismatch import MismatchDumpPart
from miles.runtime.parts import Parts, RunPart
from miles.runtime.precision import PrecisionWarmup
from miles.runtime.profiling import ProfilerPart
from miles.runtime.protocols import ReportsEngineTimes
from miles.runtime.resources import EngineTimesPart, MemoryPart
from miles.runtime.speculation import OnlineDraft
from miles.runtime.teacher import load_teacher
from miles.train.critic import Critic, value_model

log = logging.getLogger("miles")


@dataclass
class Assembly:
    """What the run parts are built from: the run, and what was made on the way to it."""

    run: Run
    data: RunData
    rewards: RewardRunner
    max_seq_len: int
    mode: RolloutMode | None = None
    draft: torch.nn.Module | None = None  # --draft-model, as loaded
    eval_sets: list[EvalSet] = field(default_factory=list)
    eval_base: torch.nn.Module | None = None  # --eval-engine own: a copy of the policy as loaded

    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    @property
    def executor(self) -> Executor:
        return self.run.executor


def precision_part(a: Assembly) -> RunPart | None:
    return PrecisionWarmup(a.cfg, a.executor) if PrecisionWarmup.applies(a.cfg) else None


def faults_part(a: Assembly) -> RunPart | None:
    if not a.cfg.debug.fault_inject:
        return None
    faults = FaultInjector(a.cfg.debug.fault_inject, a.run.run_dir)
    faults.bind(a.executor.trainer, a.executor.rollout, a.rewards)
    return faults


def profiler_part(a: Assembly) -> RunPart | None:
    logging_cfg = a.cfg.logging
    if not logging_cfg.profile:
        return None
    return ProfilerPart(Path(logging_cfg.profile_dir or a.run.run_dir / "profile"), a.cfg.rollout.num_rollout)


def mismatch_part(a: Assembly) -> RunPart | None:
    return MismatchDumpPart(a.cfg, a.executor, a.run.run_dir) if a.cfg.debug.mismatch_dump_interval else None


def draft_part(a: Assembly) -> RunPart | None:
    if not a.cfg.speculative.draft_model:
        return None
    trainer = a.executor.trainer

    def trained_policy():  # on Ray, the driver's copy brought up to rank 0's weights
        trainer.sync_policy()
        return trainer.policy

    def rebuild():  # --reinit-draft-interval: from the policy as trained so far, or the draft's checkpoint
        policy = trained_policy()
        return load_draft(a.cfg.speculative, policy, policy.lm_head.weight.device)

    return OnlineDraft(a.cfg.speculative, a.executor.rollout, a.draft, rebuild, trained_policy)


def memory_part(a: Assembly) -> RunPart | None:
    return MemoryPart(a.executor, a.executor.trainer.policy.lm_head.weight.device)


def evaluation_part(a: Assembly) -> RunPart | None:
    if not a.eval_sets:
        return None
    run, cfg = a.run, a.cfg
    own = None
    if a.eval_base is not None:
        rewards = RewardRunner.from_config(cfg, a.data.task_dataset)
        mode = rollout_mode(cfg) if cfg.agent.mode_flag else None
        own = OwnEngine(cfg, a.eval_base, run.tokenizer, a.max_seq_len, a.eval_sets, rewards, mode)
        a.eval_base = None  # the engine holds it now
    else:
        log.info("evaluation on the rollout engines, between steps (training waits for it)")
    return EvaluationPart(cfg, a.eval_sets, run.feed, a.executor.trainer, run.metrics, own)


def engine_times_part(a: Assembly) -> RunPart | None:
    rollout = a.executor.rollout
    return EngineTimesPart(rollout) if isinstance(rollout, ReportsEngineTimes) else None


def export_part(a: Assembly) -> RunPart | None:
    return ExportPart(a.cfg, a.executor.trainer, a.run.tokenizer) if a.cfg.checkpoint.save_hf else None


# In calling order: `before` and phases run in it, `after` adds metrics in it.
PART_BUILDERS: list[Callable[[Assembly], RunPart | None]] = [
    precision_part, faults_part, profiler_part, mismatch_part, draft_part, memory_part, evaluation_part,
    engine_times_part, export_part,
]  # fmt: skip


def train(cfg: RunConfig) -> Path:
    """Train one policy with a resolved configuration; returns the run directory. (`miles.run.train`
    also runs multi-agent environments.)"""
    if cfg.co_evolution.env_path:
        raise MilesError("--env-path runs several agents: call miles.run.train, which dispatches to them")
    context = registry.context_length(cfg.model.model)
    if cfg.rollout.rollout_max_response_len >= context:
        raise ConfigError(
            f"--rollout-max-response-len {cfg.rollout.rollout_max_response_len} does not fit the context of "
            f"--model {cfg.model.model} ({context} tokens, prompt included); use less than {context}"
        )
    check_weights_fit(cfg.model.model, registry.config_for(cfg.model.model))
    torch.manual_seed(cfg.train.seed)
    policy, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)
    check_finite_weights(policy, cfg.model.model)
    if cfg.algo.use_r3 and not policy.config.is_moe:  # e.g. the default job's settings on SmolLM2
        log.info("--use-r3 replays MoE routing; --model %s is dense, so it is off", cfg.model.model)
        cfg.algo.use_r3 = False
    if tokenizer is None:
        raise MilesError(
            f"--model {cfg.model.model}: the checkpoint has no tokenizer (tokenizer.json); training needs one"
        )
    data = build_data(cfg)
    if cfg.debug.debug_train_only:
        data.eval_items = []  # evaluation generates, and there is no engine
    rewards = RewardRunner.from_config(cfg, data.task_dataset)
    mode = rollout_mode(cfg) if cfg.agent.mode_flag else None  # tools and agent code imported now
    parts = Parts([])
    try:
        max_seq_len = engine_context(cfg, data, tokenizer, context, mode)
        check_token_budget(cfg, data.max_prompt_len)
        return _build_and_run(cfg, policy, tokenizer, data, rewards, mode, max_seq_len, parts)
    finally:
        parts.close()
        rewards.close()
        if mode is not None:
            mode.close()


def _build_and_run(cfg, policy, tokenizer, data, rewards, mode, max_seq_len: int, parts: Parts) -> Path:
    """Everything that holds processes or threads, built in order and stopped in reverse."""
    device = resolve_device(cfg.model.device)
    critic = None
    if cfg.algo.advantage_estimator == "ppo" and not on_ray(cfg):  # from the policy as loaded, before FP8
        critic = Critic(value_model(policy, cfg.algo.critic_model, cfg.train.seed).to(device), cfg)
    draft = load_draft(cfg.speculative, policy, device) if cfg.speculative.draft_model else None
    teacher = (
        load_teacher(cfg.algo.opd_teacher_load, policy, cfg.train.seed)
        if cfg.algo.teacher_in_trainer
        else None
    )
    eval_sets = eval_sets_of(cfg, data)
    eval_base = copy.deepcopy(policy) if cfg.data.eval_engine == "own" and eval_sets else None  # as loaded
    executor = build_executor(cfg, policy, tokenizer, max_seq_len, draft=draft, teacher=teacher)
    log.debug("weight sync: %s, every %d rollout(s)", executor.sync.name, cfg.sync.update_weights_interval)
    try:
        if cfg.algo.advantage_estimator == "ppo" and critic is None:  # the training ranks hold it
            from miles.runtime.ray_train import RayCritic

            critic = RayCritic(executor.trainer, cfg)
        run_dir = run_dir_for(cfg)
        logging_cfg = cfg.logging
        metrics = MetricsLogger(
            run_dir,
            logging_cfg.use_tensorboard,
            logging_cfg.use_wandb,
            logging_cfg.wandb_project,
            to_dict(cfg),
        )
        keep = None
        if path := cfg.rollout.dynamic_sampling_filter_path:
            keep = (
                nonconstant_reward
                if path == "default"
                else load_function(path, "--dynamic-sampling-filter-path")
            )
        num_experts = policy.config.num_experts or 0
        feed = RolloutFeed(cfg, executor, data, rewards, keep, mode, num_experts)
        run = Run(
            cfg, tokenizer, executor, Learner(cfg, executor.trainer, critic), feed, parts, metrics, run_dir
        )
        try:
            assembly = Assembly(run, data, rewards, max_seq_len, mode, draft, eval_sets, eval_base)
            parts.parts.extend(p for build in PART_BUILDERS if (p := build(assembly)) is not None)
            return run_loop(run)
        finally:
            feed.close()
            metrics.close()
    finally:
        executor.rollout.shutdown()  # Ray: stop the actors, free the placement group


def engine_context(cfg: RunConfig, data: RunData, tokenizer, context: int, mode: RolloutMode | None) -> int:
    """The engines' max_seq_len: the longest prompt (with what a rollout mode adds) plus the
    response budget, within the model's context; a multi-turn mode learns it too."""
    overhead = mode.prompt_overhead(tokenizer) if mode is not None else 0
    if overhead is not None:  # e.g. the tools' descriptions
        data.max_prompt_len += overhead
    max_seq_len = min(context, data.max_prompt_len + cfg.rollout.rollout_max_response_len + 1)
    if overhead is None:  # an agent writes its own prompts
        max_seq_len = context
    if mode is not None:  # conversations stop before they outgrow it
        mode.max_seq_len = max_seq_len
    return max_seq_len


def check_finite_weights(model: torch.nn.Module, name: str) -> None:
    """A checkpoint holding NaN/inf trains nothing (every step would be skipped): refuse it now."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise MilesError(
            f"--model {name}: {len(bad)} weight tensors hold NaN or inf (e.g. {bad[0]}); every step would be skipped. "
            "Load a checkpoint saved before the run diverged"
        )


def check_token_budget(cfg: RunConfig, longest_prompt: int) -> None:
    """A token budget must hold the longest sample the run can train on (no sample is split)."""
    budget, response = cfg.train.max_tokens_per_gpu, cfg.rollout.rollout_max_response_len
    if cfg.train.use_dynamic_batch_size and budget is not None and budget < longest_prompt + response:
        raise ConfigError(
            f"--max-tokens-per-gpu {budget} is smaller than the longest sample this run can train on: its longest "
            f"prompt ({longest_prompt} tokens) + --rollout-max-response-len {response} = {longest_prompt + response} "
            f"tokens, and a sample is never split; use at least {longest_prompt + response}"
        )
