"""`miles train` with a `co_evolution:` environment: several policies trained together.

Each agent has its own weights (a copy of --model), optimizer, rollout engine and checkpoint
(runs/.../agents/<name>/). One step:

1. choose who trains: every agent (simultaneous) or the active one, switched every
   --co-evolution-interval steps (alternating);
2. for each training agent, choose its opponents: the current ones, or (--population-size K)
   for each opponent one of its last K snapshots at random (fictitious self-play);
3. play --episodes-per-step episodes (`miles.multiagent.episodes.play`): each agent's tokens
   are loss-masked into its own samples;
4. advantage = reward - that agent's moving-average baseline (per role); train; push the new
   weights to its engine. Frozen agents' weights do not change (bitwise).

Metrics per step: each agent's reward and whether it trained, and what the environment reports
(Kuhn Poker: exact exploitability of the current and of the average policies, the game value
and every information set's P(bet)).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.config.schema import RunConfig
from miles.errors import ConfigError
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.multiagent.actions import warm_up_actions
from miles.multiagent.episodes import Environment, play, role_advantages
from miles.rollout import Engine, SamplingParams
from miles.runtime.metrics import MetricsLogger, run_dir_for
from miles.train.policy_trainer import PolicyTrainer

log = logging.getLogger("miles")


def build_env(path: str, seed: int) -> Environment:
    if path in ("kuhn_poker", "kuhn"):
        from miles.multiagent.kuhn import KuhnPoker

        return KuhnPoker(seed)
    from miles.rewards.functions import load_function

    cls = load_function(path, "--env-path")
    env = cls(seed=seed) if isinstance(cls, type) else cls
    missing = [m for m in ("agents", "reset", "current", "observe", "act", "rewards") if not hasattr(env, m)]
    if missing:
        raise ConfigError(
            f"--env-path {path}: the environment lacks {', '.join(missing)} (see miles/multiagent/episodes.py)"
        )
    return env


def agent_config(cfg: RunConfig) -> RunConfig:
    """The trainer settings of one agent: one optimizer step per RL step over its episodes."""
    out = copy.deepcopy(cfg)
    n = cfg.co_evolution.episodes_per_step
    out.train.global_batch_size = n
    out.train.num_steps_per_rollout = 1
    out.train.micro_batch_size = min(cfg.train.micro_batch_size, n)
    out.train.share_prompts = False
    return out


@dataclass
class Agent:
    name: str
    policy: torch.nn.Module
    trainer: PolicyTrainer
    engine: Engine
    snapshot_engine: Engine | None  # plays an opponent's past snapshot (with a population)
    snapshots: deque = field(default_factory=deque)
    baseline: float = 0.0

    def sync(self, version: int) -> None:
        self.engine.update_weights(self.policy.state_dict().items(), version=version)

    def snapshot(self) -> None:
        self.snapshots.append({k: v.detach().clone() for k, v in self.policy.state_dict().items()})


def opponent_engines(agents: dict[str, Agent], learner: str, rng: random.Random) -> tuple[dict, dict]:
    """Engines for an episode batch of `learner` against a snapshot of each other agent drawn
    uniformly from its population; returns the engines and the drawn snapshot indices."""
    engines, picks = {learner: agents[learner].engine}, {}
    for name, agent in agents.items():
        if name == learner:
            continue
        picks[name] = rng.randrange(len(agent.snapshots))
        agent.snapshot_engine.update_weights(agent.snapshots[picks[name]].items())
        engines[name] = agent.snapshot_engine
    return engines, picks


def train_agents(cfg: RunConfig) -> Path:
    co = cfg.co_evolution
    env = build_env(co.env_path, cfg.train.seed)
    run_dir = run_dir_for(cfg)
    metrics = MetricsLogger(run_dir, cfg.logging.use_tensorboard)
    metrics.archive_previous()
    rng = random.Random(cfg.train.seed)
    acfg = agent_config(cfg)
    params = SamplingParams(
        temperature=cfg.rollout.rollout_temperature,
        max_new_tokens=getattr(env, "max_new_tokens", 1),
        ignore_eos=True,
    )
    agents: dict[str, Agent] = {}
    base, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)  # a shared base, copied per agent
    engine_size = max(8, co.episodes_per_step)
    for i, name in enumerate(env.agents):
        torch.manual_seed(cfg.train.seed + i)
        policy = copy.deepcopy(base)
        if co.action_warmup_steps and hasattr(env, "action_tokens") and hasattr(env, "warmup_prompts"):
            outside = warm_up_actions(
                policy, tokenizer, env.warmup_prompts(name), env.action_tokens, co.action_warmup_steps, 1e-3
            )
            log.info(
                "%s: warm-up leaves %.3f of the first move's probability outside %s",
                name,
                outside,
                env.action_tokens,
            )
        snapshot_engine = None
        if co.population_size is not None:
            snapshot_engine = Engine(
                copy.deepcopy(policy), tokenizer, engine_size, seed=cfg.rollout.rollout_seed + 100 + i
            )
        agents[name] = Agent(
            name,
            policy,
            PolicyTrainer(policy, acfg),
            Engine(copy.deepcopy(policy), tokenizer, engine_size, seed=cfg.rollout.rollout_seed + i),
            snapshot_engine,
            deque(maxlen=co.population_size or 1),
        )
        if co.population_size is not None:
            agents[name].snapshot()
    del base
    names = list(env.agents)
    tracker = env.tracker() if hasattr(env, "tracker") else None
    steps = cfg.rollout.num_rollout
    for step in range(steps):
        t0 = time.perf_counter()
        if co.strategy == "alternating":
            training = [names[(step // co.co_evolution_interval) % len(names)]]
        else:
            training = names
        record: dict[str, float] = {}
        batches: dict[str, list] = {}
        if co.population_size is None:  # everyone plays the current opponents: one set of episodes
            _, samples = play(
                env, {n: agents[n].engine for n in names}, tokenizer, co.episodes_per_step, params
            )
            batches = {n: samples[n] for n in training}
            for n in names:
                record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
        else:
            for n in training:
                engines, picks = opponent_engines(agents, n, rng)
                record.update({f"opponent_snapshot_{n}_{o}": pick for o, pick in picks.items()})
                _, samples = play(env, engines, tokenizer, co.episodes_per_step, params)
                batches[n] = samples[n]
                record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
        rollout_time = time.perf_counter() - t0
        for n in names:
            agent = agents[n]
            record[f"agent_trained_{n}"] = float(n in batches)
            if n not in batches or not batches[n]:
                continue
            rewards = [float(s.reward) for s in batches[n]]
            out = agent.trainer.train(batches[n], role_advantages(batches[n], agent.baseline))
            decay = co.role_baseline_decay
            agent.baseline = decay * agent.baseline + (1 - decay) * _mean(rewards)
            record[f"agent_baseline_{n}"] = agent.baseline
            record[f"agent_pg_loss_{n}"] = out.get("pg_loss", 0.0)
            record[f"agent_response_len_{n}"] = _mean([s.response_length for s in batches[n]])
            agent.sync(step + 1)
        if co.population_size is not None and (step + 1) % co.co_evolution_interval == 0:
            for n in names:
                agents[n].snapshot()
        if tracker is not None:
            record.update(tracker(env, {n: agents[n].policy for n in names}, tokenizer))
        record["reward_mean"] = _mean(
            [record[f"agent_reward_{n}"] for n in names if f"agent_reward_{n}" in record]
        )
        record["rollout_time"] = rollout_time
        record["step_time"] = time.perf_counter() - t0
        metrics.log(step, record)
        if step % 10 == 0 or step == steps - 1:
            shown = {
                k: round(v, 4) for k, v in record.items() if k.startswith(("exploitability", "agent_reward_"))
            }
            log.info("step %d/%d %s", step + 1, steps, shown)
    for n in names:
        save_model(agents[n].policy, run_dir / "agents" / n, tokenizer)
    metrics.close()
    return run_dir


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
