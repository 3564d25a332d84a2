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
import functools
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
from miles.diagnostics.metrics_file import MetricsLogger
from miles.errors import ConfigError
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.multiagent.actions import warm_up_actions
from miles.multiagent.agent_state import resume_agents, save_agents
from miles.multiagent.episodes import EnvSpec, role_advantages
from miles.rollout import SamplingParams
from miles.runtime.executors import Executor, build_executor
from miles.runtime.faults import FaultInjector
from miles.runtime.metrics import run_dir_for
from miles.runtime.parts import Parts, RunPart, Step, due
from miles.runtime.profiling import ProfilerPart
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
    """Train every agent of --env-path together; returns the run directory. The run parts of a
    single-policy run that apply to several agents (fault injection, the profiler) take part in
    each step the same way, and their state is checkpointed with the agents'."""
    co = cfg.co_evolution
    spec = build_env(co.env_path, cfg.train.seed)
    run_dir = run_dir_for(cfg)
    metrics = MetricsLogger(run_dir, cfg.logging.use_tensorboard)
    rng = random.Random(cfg.train.seed)
    base, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)  # a shared base, copied per agent
    agents = build_agents(cfg, spec, base, tokenizer)
    del base
    parts = Parts(agent_parts(cfg, run_dir, agents))
    try:
        start = resume_agents(cfg, agents, rng, spec.env, spec.tracker, metrics, parts)
        parts.begin(start)
        steps = cfg.rollout.num_rollout
        for step_id in range(start, steps):
            step = Step(step_id, last=step_id == steps - 1)
            parts.before(step)
            co_evolution_step(cfg, spec, agents, tokenizer, rng, step, parts)
            parts.after(step)
            metrics.log(step_id, step.metrics)
            if step_id % 10 == 0 or step.last:
                shown = {k: round(v, 4) for k, v in step.metrics.items() if k.startswith(SHOWN)}
                log.info("step %d/%d %s", step_id + 1, steps, shown)
            if cfg.checkpoint.save and (step.last or due(cfg.checkpoint.save_interval, step_id)):
                save_agents(cfg.checkpoint.save, step_id, agents, tokenizer, rng, spec.env, spec.tracker,
                            parts.state_dict(), functools.partial(parts.mark, "checkpoint", step))  # fmt: skip
        parts.end()
        for n, agent in agents.items():
            save_model(agent.policy(), run_dir / "agents" / n, tokenizer)
    finally:
        parts.close()
        for agent in agents.values():
            agent.rollout.shutdown()
        metrics.close()
    return run_dir


def build_agents(cfg: RunConfig, spec: EnvSpec, base, tokenizer) -> dict[str, Agent]:
    """One agent per player of the environment, each over its own copy of `base` (after its
    action warm-up, which a resumed run does not repeat: it loads its trained weights instead)."""
    co, env = cfg.co_evolution, spec.env
    unknown = sorted(set(co.agent_overrides) - set(env.agents))
    if unknown:
        raise ConfigError(
            f"--agent-overrides names {unknown}; the agents of {co.env_path} are {list(env.agents)}"
        )
    resuming = bool(cfg.checkpoint.load) and latest_checkpoint(cfg.checkpoint.load) is not None
    max_seq_len = min(registry.context_length(cfg.model.model), spec.max_seq_len)
    requests = co.episodes_per_step * spec.requests_per_episode
    agents: dict[str, Agent] = {}
    for i, name in enumerate(env.agents):
        torch.manual_seed(cfg.train.seed + i)
        policy = copy.deepcopy(base)
        if co.action_warmup_steps and spec.warms_up and not resuming:
            outside = warm_up_actions(
                policy, tokenizer, env.warmup_prompts(name), env.action_tokens, co.action_warmup_steps, 1e-3
            )
            log.info(
                "%s: warm-up leaves %.3f of the first move's probability outside %s",
                name, outside, env.action_tokens,
            )  # fmt: skip
        agents[name] = make_agent(name, i, policy, tokenizer, cfg, max_seq_len, requests, resuming)
        if co.population_size is not None:
            agents[name].snapshot(0)
    return agents


def agent_parts(cfg: RunConfig, run_dir: Path, agents: dict[str, Agent]) -> list[RunPart]:
    """The run parts of a multi-agent run: --fault-inject (the driver) and --profile."""
    out: list[RunPart] = []
    if cfg.debug.fault_inject:
        out.append(FaultInjector(cfg.debug.fault_inject, run_dir))
    if cfg.logging.profile:
        out.append(
            ProfilerPart(Path(cfg.logging.profile_dir or run_dir / "profile"), cfg.rollout.num_rollout)
        )
    return out


def co_evolution_step(cfg: RunConfig, spec: EnvSpec, agents: dict[str, Agent], tokenizer, rng: random.Random,
                      step: Step, parts: Parts) -> None:  # fmt: skip
    """One step: play the episodes (rollout), train who trains on its own tokens (train), push
    their weights (sync), then the interval boundary's snapshots and KL references."""
    co, names = cfg.co_evolution, list(spec.env.agents)
    t0 = time.perf_counter()
    with parts.phase("rollout", step):
        batches, states = play(cfg, spec, agents, tokenizer, rng, step)
    if spec.episode_metrics is not None:
        step.metrics.update(spec.episode_metrics(states))
    rollout_time = time.perf_counter() - t0
    with parts.phase("train", step):
        trained = {n: train_agent(co, agents[n], batches[n], step.metrics) for n in names if batches.get(n)}
    with parts.phase("sync", step):
        for n in trained:
            agents[n].push(step.rollout_id + 1)
    for n in names:
        step.metrics[f"agent_trained_{n}"] = float(n in batches)
    if (step.rollout_id + 1) % co.co_evolution_interval == 0:  # an interval boundary
        for agent in agents.values():
            if co.population_size is not None:
                agent.snapshot(step.rollout_id + 1)
            if agent.reference_moves:  # the moving KL reference moves to where the agent is
                agent.hold_reference()
    if spec.tracker is not None:
        policies = Policies(agents)  # fetched only if the tracker reads them (Ray: from rank 0)
        step.metrics.update(
            spec.tracker(spec.env, policies, tokenizer, {n: agents[n].rollout for n in names})
        )
    rewards = [step.metrics[f"agent_reward_{n}"] for n in names if f"agent_reward_{n}" in step.metrics]
    step.metrics["reward_mean"] = _mean(rewards)
    step.metrics["rollout_time"] = rollout_time
    step.metrics["step_time"] = time.perf_counter() - t0


def play(cfg: RunConfig, spec: EnvSpec, agents: dict[str, Agent], tokenizer, rng: random.Random,
         step: Step) -> tuple[dict[str, list], list]:  # fmt: skip
    """The step's episodes: each training agent's samples (who trains: every agent, or the
    active one of --strategy alternating), and the episodes' states; rewards and win rates go
    into `step.metrics`."""
    co, names, record = cfg.co_evolution, list(spec.env.agents), step.metrics
    params = SamplingParams(
        temperature=cfg.rollout.rollout_temperature, max_new_tokens=spec.max_new_tokens, ignore_eos=True
    )
    training = names
    if co.strategy == "alternating":
        training = [names[(step.rollout_id // co.co_evolution_interval) % len(names)]]
    if co.population_size is None:  # everyone plays the current opponents: one set of episodes
        engines = {n: agents[n].rollout for n in names}
        seed = step_seed(cfg, step.rollout_id)
        states, samples = spec.episodes(engines, tokenizer, co.episodes_per_step, params, seed=seed)
        for n in names:
            record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
            record.update(win_rates(samples[n], n, {}, agents))
        return {n: samples[n] for n in training}, states
    batches = {}
    for n in training:
        with against_snapshots(agents, n, rng) as picks:
            engines = {m: agents[m].rollout for m in names}
            seed = step_seed(cfg, step.rollout_id, names.index(n))
            states, samples = spec.episodes(engines, tokenizer, co.episodes_per_step, params, seed=seed)
        record.update({f"opponent_snapshot_{n}_{o}": pick for o, pick in picks.items()})
        record.update(win_rates(samples[n], n, picks, agents))
        batches[n] = samples[n]
        record[f"agent_reward_{n}"] = _mean([s.reward for s in samples[n]])
    return batches, states


def train_agent(co, agent: Agent, samples: list, record: dict) -> dict[str, float]:
    """One optimizer step of `agent` on its own samples (advantage: reward - its baseline)."""
    n, world = agent.name, agent.executor.trainer.world
    batch = samples[: len(samples) - len(samples) % world]  # whole shards per rank
    rewards = [float(s.reward) for s in batch]
    out = agent.executor.trainer.train(batch, role_advantages(batch, agent.baseline))
    agent.baseline = co.role_baseline_decay * agent.baseline + (1 - co.role_baseline_decay) * _mean(rewards)
    record[f"agent_baseline_{n}"] = agent.baseline
    record[f"agent_pg_loss_{n}"] = out.get("pg_loss", 0.0)
    record[f"agent_response_len_{n}"] = _mean([s.response_length for s in batch])
    record[f"agent_train_ranks_{n}"] = world
    return out


def step_seed(cfg: RunConfig, step: int, learner: int = -1) -> int:
    """The sampling seed of one step's episodes (per learner with a population)."""
    return hash((cfg.rollout.rollout_seed, step, learner))


SHOWN = ("exploitability", "agent_reward_", "solver_eval_accuracy", "learnable_share")


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
