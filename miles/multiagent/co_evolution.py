"""`miles train` with a `co_evolution:` environment: several policies trained together.

Each agent has its own weights (a copy of --model), optimizer, rollout engine and checkpoint
(runs/.../agents/<name>/), built by the same runtime as a single-policy run
(`miles.runtime.executors.build_executor`): in this process, or training ranks and engine
actors on Ray when --actor-num-gpus-per-node / --rollout-num-gpus ask for more than one. One step:

1. choose who trains: every agent (simultaneous) or the active one, switched every
   --co-evolution-interval steps (alternating);
2. for each training agent, choose its opponents: the current ones, or (--population-size K)
   for each opponent one of its last K snapshots at random (fictitious self-play), loaded
   into that opponent's own engine for the episodes and replaced by its current weights after;
3. play --episodes-per-step episodes (`miles.multiagent.episodes.play`, or the environment's own
   `play`): each agent's tokens are loss-masked into its own samples;
4. advantage = reward - that agent's own baseline (`role_advantages`); train; push the new
   weights to its engine. Frozen agents' weights do not change (bitwise).
5. every --co-evolution-interval steps (with --magnet-kl-coef, on by default), each agent's KL
   reference moves to its policy now: the pull keeps a learner from turning deterministic (a
   policy at P = 1 gets no gradient back) and damps the chase of simultaneous updates, and,
   unlike a pull to the start, does not hold it there (magnetic mirror descent).

Metrics per step: each agent's reward, win rate (against each population member by age) and
whether it trained, and what the environment reports (Kuhn Poker: exact exploitability of the
current and of the average policies; proposer/solver: held-out accuracy and the learnable share).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections import deque
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.config.schema import RunConfig
from miles.errors import ConfigError
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.multiagent.actions import warm_up_actions
from miles.multiagent.agent_state import resume_agents, save_agents
from miles.multiagent.episodes import EnvSpec, role_advantages
from miles.rollout import SamplingParams
from miles.runtime.executors import Executor, build_executor
from miles.runtime.loop import due
from miles.runtime.metrics import MetricsLogger, run_dir_for
from miles.runtime.train_state import latest_checkpoint
from miles.train.policy_trainer import needs_reference

log = logging.getLogger("miles")

BUILT_IN = {
    "kuhn_poker": "miles.multiagent.kuhn:KuhnPoker",
    "kuhn": "miles.multiagent.kuhn:KuhnPoker",
    "proposer_solver": "miles.multiagent.proposer_solver:ProposerSolver",
}


def build_env(path: str, seed: int) -> EnvSpec:
    from miles.rewards.functions import load_function

    takes = f"one of {sorted(BUILT_IN)} or module:Class (a class or factory of an environment)"
    cls = load_function(BUILT_IN.get(path, path), "--env-path", takes)
    env = cls(seed=seed) if isinstance(cls, type) else cls
    try:
        return EnvSpec.of(env)
    except TypeError as e:
        turn_based = ("agents", "reset", "current", "observe", "act", "rewards")
        missing = [m for m in turn_based if m not in dir(env)]
        raise ConfigError(
            f"--env-path {path}: the environment lacks {', '.join(missing)} (or `agents` and its own "
            "`play`; see miles/multiagent/episodes.py)"
        ) from e


def agent_config(cfg: RunConfig, index: int, requests: int, name: str = "") -> RunConfig:
    """Agent `index`'s settings: its --agent-overrides, one optimizer step per RL step over its
    samples (at most one step's `requests`), its own sampling seed, an engine batch that holds
    those requests."""
    from miles.config.loader import with_overrides

    overrides = cfg.co_evolution.agent_overrides.get(name)
    out = with_overrides(cfg, overrides, f"--agent-overrides {name}") if overrides else copy.deepcopy(cfg)
    out.train.global_batch_size = requests
    out.train.num_steps_per_rollout = 1
    out.train.micro_batch_size = min(cfg.train.micro_batch_size, requests)
    out.train.share_prompts = False
    out.rollout.rollout_seed = cfg.rollout.rollout_seed + index
    out.rollout.rollout_max_batch_size = max(8, min(requests, cfg.rollout.rollout_max_batch_size))
    if moving_reference(cfg, name):  # a KL reference, moved at each boundary
        out.algo.use_kl_loss, out.algo.kl_loss_coef = True, cfg.co_evolution.magnet_kl_coef
    return out


def moving_reference(cfg: RunConfig, name: str) -> bool:
    """Whether agent `name`'s KL reference moves (--magnet-kl-coef): not where --use-kl-loss, for
    every agent or in its --agent-overrides, asks for a fixed pull to its start."""
    overrides = cfg.co_evolution.agent_overrides.get(name) or {}
    own = cfg.algo.use_kl_loss or any(str(k).replace("-", "_") == "use_kl_loss" for k in overrides)
    return bool(cfg.co_evolution.magnet_kl_coef) and not own


@dataclass
class Agent:
    name: str
    executor: Executor  # its trainer, engine(s) and the weight sync between them
    snapshots: deque = field(default_factory=deque)  # (step, HF-named weights), oldest first
    baseline: float = 0.0
    version: int = 0
    reference: dict | None = None  # HF-named weights its KL reference holds (None: none), checkpointed
    reference_moves: bool = False  # --magnet-kl-coef: it moves to the policy at every interval boundary

    def hold_reference(self, weights: dict | None = None) -> None:
        """The KL reference becomes the policy now (or the saved `weights`, on resume)."""
        if weights is None:
            weights = {k: v.detach().clone() for k, v in self.executor.trainer.hf_weights().items()}
        self.executor.trainer.reset_reference(weights)
        self.reference = weights

    @property
    def rollout(self):
        return self.executor.rollout

    def policy(self) -> torch.nn.Module:
        """The driver's copy of the policy, up to date (Ray: fetched from training rank 0)."""
        self.executor.trainer.sync_policy()
        return self.executor.trainer.policy

    def push(self, version: int) -> None:
        self.executor.sync.push(version)
        self.version = version

    def snapshot(self, step: int) -> None:
        weights = self.executor.trainer.hf_weights()
        self.snapshots.append((step, {k: v.detach().clone() for k, v in weights.items()}))


def make_agent(
    name: str, index: int, policy, tokenizer, cfg: RunConfig, max_seq_len: int, requests: int, resuming: bool
) -> Agent:
    """Agent `name` over `policy` (after its warm-up). A KL reference, moving or fixed, is taken
    now and checkpointed: a resumed run (no warm-up) restores it instead of rebuilding it."""
    acfg = agent_config(cfg, index, requests, name)
    agent = Agent(
        name,
        build_executor(acfg, policy, tokenizer, max_seq_len),
        deque(maxlen=cfg.co_evolution.population_size or 1),
    )
    agent.reference_moves = moving_reference(cfg, name)
    held = needs_reference(acfg) and not (acfg.lora.enabled or acfg.algo.teacher_in_trainer)
    if held and not resuming:
        agent.hold_reference()
    return agent


@contextmanager
def against_snapshots(agents: dict[str, Agent], learner: str, rng: random.Random):
    """While open, each opponent of `learner` plays one of its snapshots drawn uniformly, in its
    own engine; yields {opponent: index drawn}. On exit the opponents' engines get their current
    weights back."""
    picks = {}
    try:
        for name, agent in agents.items():
            if name != learner:
                picks[name] = rng.randrange(len(agent.snapshots))
                step, weights = agent.snapshots[picks[name]]
                agent.rollout.update_weights(weights.items(), version=step)
        yield picks
    finally:
        for name in picks:
            agents[name].push(agents[name].version)


def win_rates(samples, learner: str, picks: dict[str, int], agents: dict[str, Agent]) -> dict[str, float]:
    """The share of episodes `learner` won (reward > 0), also under the name of each opponent's
    drawn snapshot by its age (0: the newest)."""
    rate = _mean([float(s.reward > 0) for s in samples])
    out = {f"win_rate_{learner}": rate}
    for name, pick in picks.items():
        age = len(agents[name].snapshots) - 1 - pick
        out[f"win_rate_{learner}_vs_{name}_age{age}"] = rate
    return out


class Policies(Mapping):
    """Each agent's up-to-date policy, by name, fetched on first access."""

    def __init__(self, agents: dict[str, Agent]) -> None:
        self.agents, self.cache = agents, {}

    def __getitem__(self, name: str) -> torch.nn.Module:
        if name not in self.cache:
            self.cache[name] = self.agents[name].policy()
        return self.cache[name]

    def __iter__(self):
        return iter(self.agents)

    def __len__(self) -> int:
        return len(self.agents)


def train_agents(cfg: RunConfig) -> Path:
    co = cfg.co_evolution
    spec = build_env(co.env_path, cfg.train.seed)
    env = spec.env
    run_dir = run_dir_for(cfg)
    metrics = MetricsLogger(run_dir, cfg.logging.use_tensorboard)
    rng = random.Random(cfg.train.seed)
    resuming = bool(cfg.checkpoint.load) and latest_checkpoint(cfg.checkpoint.load) is not None
    params = SamplingParams(
        temperature=cfg.rollout.rollout_temperature,
        max_new_tokens=spec.max_new_tokens,
        ignore_eos=True,
    )
    base, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)  # a shared base, copied per agent
    max_seq_len = min(registry.context_length(cfg.model.model), spec.max_seq_len)
    requests = co.episodes_per_step * spec.requests_per_episode
    unknown = sorted(set(co.agent_overrides) - set(env.agents))
    if unknown:
        raise ConfigError(
            f"--agent-overrides names {unknown}; the agents of {co.env_path} are {list(env.agents)}"
        )
    agents: dict[str, Agent] = {}
    for i, name in enumerate(env.agents):
        torch.manual_seed(cfg.train.seed + i)
        policy = copy.deepcopy(base)
        warm_up = co.action_warmup_steps and spec.warms_up
        if warm_up and not resuming:  # a resumed run loads its trained weights instead
            outside = warm_up_actions(
                policy, tokenizer, env.warmup_prompts(name), env.action_tokens, co.action_warmup_steps, 1e-3
            )
            log.info(
                "%s: warm-up leaves %.3f of the first move's probability outside %s",
                name,
                outside,
                env.action_tokens,
            )
        agents[name] = make_agent(name, i, policy, tokenizer, cfg, max_seq_len, requests, resuming)
        if co.population_size is not None:
            agents[name].snapshot(0)
    del base
    names = list(env.agents)
    episodes, tracker = spec.episodes, spec.tracker
    steps = cfg.rollout.num_rollout
    start = resume_agents(cfg, agents, rng, env, tracker, metrics)
    try:
        for step in range(start, steps):
            t0 = time.perf_counter()
            if co.strategy == "alternating":
                training = [names[(step // co.co_evolution_interval) % len(names)]]
            else:
                training = names
            record: dict[str, float] = {}
            batches: dict[str, list] = {}
            if co.population_size is None:  # everyone plays the current opponents: one set of episodes
                engines = {n: agents[n].rollout for n in names}
                states, samples = episodes(
                    engines, tokenizer, co.episodes_per_step, params, seed=step_seed(cfg, step)
                )
                batches = {n: samples[n] for n in training}
                for n in names:
                    record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
                    record.update(win_rates(samples[n], n, {}, agents))
            else:
                for n in training:
                    with against_snapshots(agents, n, rng) as picks:
                        engines = {m: agents[m].rollout for m in names}
                        seed = step_seed(cfg, step, names.index(n))
                        states, samples = episodes(
                            engines, tokenizer, co.episodes_per_step, params, seed=seed
                        )
                    record.update({f"opponent_snapshot_{n}_{o}": pick for o, pick in picks.items()})
                    record.update(win_rates(samples[n], n, picks, agents))
                    batches[n] = samples[n]
                    record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
            if spec.episode_metrics is not None:
                record.update(spec.episode_metrics(states))
            rollout_time = time.perf_counter() - t0
            for n in names:
                agent = agents[n]
                record[f"agent_trained_{n}"] = float(n in batches)
                if n not in batches or not batches[n]:
                    continue
                world = agent.executor.trainer.world
                batch = batches[n][: len(batches[n]) - len(batches[n]) % world]  # whole shards per rank
                rewards = [float(s.reward) for s in batch]
                out = agent.executor.trainer.train(batch, role_advantages(batch, agent.baseline))
                decay = co.role_baseline_decay
                agent.baseline = decay * agent.baseline + (1 - decay) * _mean(rewards)
                record[f"agent_baseline_{n}"] = agent.baseline
                record[f"agent_pg_loss_{n}"] = out.get("pg_loss", 0.0)
                record[f"agent_response_len_{n}"] = _mean([s.response_length for s in batch])
                record[f"agent_train_ranks_{n}"] = world
                agent.push(step + 1)
            if (step + 1) % co.co_evolution_interval == 0:  # an interval boundary
                for n in names:
                    if co.population_size is not None:
                        agents[n].snapshot(step + 1)
                    if agents[n].reference_moves:  # the moving KL reference moves to where the agent is
                        agents[n].hold_reference()
            if tracker is not None:
                policies = Policies(agents)  # fetched only if the tracker reads them (Ray: from rank 0)
                record.update(tracker(env, policies, tokenizer, {n: agents[n].rollout for n in names}))
            record["reward_mean"] = _mean(
                [record[f"agent_reward_{n}"] for n in names if f"agent_reward_{n}" in record]
            )
            record["rollout_time"] = rollout_time
            record["step_time"] = time.perf_counter() - t0
            metrics.log(step, record)
            if step % 10 == 0 or step == steps - 1:
                shown = {k: round(v, 4) for k, v in record.items() if k.startswith(SHOWN)}
                log.info("step %d/%d %s", step + 1, steps, shown)
            if cfg.checkpoint.save and (step == steps - 1 or due(cfg.checkpoint.save_interval, step)):
                save_agents(cfg.checkpoint.save, step, agents, tokenizer, rng, env, tracker)
        for n in names:
            save_model(agents[n].policy(), run_dir / "agents" / n, tokenizer)
    finally:
        for agent in agents.values():
            agent.rollout.shutdown()
        metrics.close()
    return run_dir


def step_seed(cfg: RunConfig, step: int, learner: int = -1) -> int:
    """The sampling seed of one step's episodes (per learner with a population)."""
    return hash((cfg.rollout.rollout_seed, step, learner))


SHOWN = ("exploitability", "agent_reward_", "solver_eval_accuracy", "learnable_share")


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
