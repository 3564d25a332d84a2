"""`miles eval`: a checkpoint (`--load`) or a model (`--model`) evaluated alone, on the run's
evaluation sets, with the engine the run would build: the figures equal the run's own evaluation
at the step the checkpoint was saved."""

from __future__ import annotations

import copy
import logging

import torch

from miles.agents.modes import rollout_mode
from miles.config.schema import RunConfig
from miles.data.run_data import build_data
from miles.errors import ConfigError
from miles.lora.adapters import merge_and_unload, spec_of
from miles.models import registry
from miles.rewards.runner import RewardRunner
from miles.rollout.evaluation import eval_sets_of, evaluate_all
from miles.runtime.assemble import engine_context
from miles.runtime.executors import local_engine
from miles.runtime.train_state import load_latest
from miles.train.prepare import add_lora

log = logging.getLogger("miles")


def evaluate_checkpoint(cfg: RunConfig) -> dict[str, float]:
    """Every evaluation set's metrics for the policy of `cfg` (its --load checkpoint's weights)."""
    torch.manual_seed(cfg.train.seed)
    policy, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)
    if cfg.lora.enabled:
        add_lora(policy, cfg)
    if cfg.checkpoint.load:
        loaded = load_latest(cfg.checkpoint.load, {"model": policy})
        if loaded is None:
            raise ConfigError(f"--load {cfg.checkpoint.load}: holds no checkpoint to evaluate")
        log.info("evaluating %s", loaded[0])
    data = build_data(cfg)
    sets = eval_sets_of(cfg, data)
    if not sets:
        raise ConfigError(
            "nothing to evaluate: give --eval-size > 0 (with --task), --eval-prompt-data or --eval-config"
        )
    rewards = RewardRunner.from_config(cfg, data.task_dataset)
    mode = rollout_mode(cfg) if cfg.agent.mode_flag else None
    try:
        context = registry.context_length(cfg.model.model)
        served = copy.deepcopy(policy)
        if spec_of(served) is not None:  # the engines serve base + adapter merged
            merge_and_unload(served)
        engine = local_engine(cfg, served, tokenizer, engine_context(cfg, data, tokenizer, context, mode))
        return evaluate_all(engine, sets, cfg, rewards, mode)
    finally:
        rewards.close()
        if mode is not None:
            mode.close()
