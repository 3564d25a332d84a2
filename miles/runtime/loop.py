"""The RL loop: generate, score, compute advantages, train, sync weights, evaluate, log, save.

`train(cfg)` builds a `Run` (model, data, rewards, and the trainer / rollout / weight-sync trio
of `miles.runtime.executors`); `run_loop` drives it through the interfaces of
`miles.runtime.protocols`, with the same calls in one process or on Ray.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from miles.agents.modes import RolloutMode, rollout_mode
from miles.algo.distill import TeacherServer, distill, load_teacher
from miles.algo.filters import GroupFilter, nonconstant_reward
from miles.config import to_dict
from miles.config.schema import RunConfig
from miles.data.run_data import RunData, build_data
from miles.diagnostics.memory import describe_bytes, memory_metrics, step_peak_memory
from miles.diagnostics.mismatch_dump import save_dump
from miles.errors import ConfigError, MilesError
from miles.faults import FaultInjector
from miles.lora.peft_files import export_lora
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.quant.convert import low_precision, mode_at, start_mode
from miles.rewards.functions import load_function
from miles.rewards.runner import RewardRunner
from miles.rollout.debug_data import load_rollout, save_rollout
from miles.rollout.drafts import load_draft
from miles.rollout.evaluation import EvalSet, eval_sets_of, evaluate_all
from miles.rollout.groups import collect_groups
from miles.rollout.partial import PartialRollout
from miles.runtime.devices import resolve_device
from miles.runtime.eval_engine import OwnEvaluation
from miles.runtime.executors import build_executor, on_ray
from miles.runtime.metrics import MetricsLogger, run_dir_for
from miles.runtime.profiling import StepProfiler
from miles.runtime.protocols import ReadsWeightsBack, ReportsEngineTimes, Rollout, SwitchesPrecision, Trainer
from miles.runtime.speculation import OnlineDraft
from miles.runtime.train_state import carries_mode_state, resume, save_checkpoint
from miles.sync.strategy import WeightSync
from miles.train.critic import Critic, value_model
from miles.train.sample_advantages import compute_advantages

log = logging.getLogger("miles")


@dataclass
class Run:
    """Everything one `miles train` run drives."""

    cfg: RunConfig
    policy: torch.nn.Module
    tokenizer: object
    data: RunData
    rewards: RewardRunner
    keep: GroupFilter | None  # --dynamic-sampling-filter-path
    trainer: Trainer
    rollout: Rollout
    sync: WeightSync
    metrics: MetricsLogger
    run_dir: Path
    precision_mode: str = ""  # bf16 | fp8 of the FP8 layers now (see switch_precision)
    critic: Critic | None = None  # --advantage-estimator ppo (a RayCritic on Ray ranks)
    speculation: OnlineDraft | None = None  # --draft-model: spec_* metrics, online draft training
    mode: RolloutMode | None = None  # multi-turn agent rollouts (--tool-path, --agent-path, ...)
    eval_sets: list[EvalSet] = field(default_factory=list)  # the held-out set and --eval-config's
    own_eval: OwnEvaluation | None = None  # --eval-engine own
    faults: FaultInjector | None = None  # --fault-inject


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
    keep = None
    if path := cfg.rollout.dynamic_sampling_filter_path:
        keep = (
            nonconstant_reward if path == "default" else load_function(path, "--dynamic-sampling-filter-path")
        )
    mode = rollout_mode(cfg) if cfg.agent.mode_flag else None  # tools and agent code imported now
    max_seq_len = engine_context(cfg, data, tokenizer, context, mode)
    check_token_budget(cfg, data.max_prompt_len)
    critic = None
    if cfg.algo.advantage_estimator == "ppo" and not on_ray(cfg):  # from the policy as loaded, before FP8
        model = value_model(policy, cfg.algo.critic_model, cfg.train.seed)
        critic = Critic(model.to(resolve_device(cfg.model.device)), cfg)
    draft = (
        load_draft(cfg.speculative, policy, resolve_device(cfg.model.device))
        if cfg.speculative.draft_model
        else None
    )
    teacher = (
        load_teacher(cfg.algo.opd_teacher_load, policy, cfg.train.seed)
        if cfg.algo.teacher_in_trainer
        else None
    )
    eval_sets = eval_sets_of(cfg, data)
    own_eval = None
    eval_base = copy.deepcopy(policy) if cfg.data.eval_engine == "own" and eval_sets else None  # as loaded
    try:
        executor = build_executor(cfg, policy, tokenizer, max_seq_len, draft=draft, teacher=teacher)
        if cfg.algo.advantage_estimator == "ppo" and critic is None:  # the training ranks hold it
            from miles.runtime.ray_train import RayCritic

            critic = RayCritic(executor.trainer, cfg)
        try:
            run_dir = run_dir_for(cfg)
            logging_cfg = cfg.logging
            metrics = MetricsLogger(
                run_dir,
                logging_cfg.use_tensorboard,
                logging_cfg.use_wandb,
                logging_cfg.wandb_project,
                to_dict(cfg),
            )
            run = Run(
                cfg, policy, tokenizer, data, rewards, keep,
                executor.trainer, executor.rollout, executor.sync, metrics, run_dir, critic=critic, mode=mode,
                eval_sets=eval_sets,
            )  # fmt: skip
            if eval_base is not None:
                eval_mode = rollout_mode(cfg) if cfg.agent.mode_flag else None
                own_eval = run.own_eval = OwnEvaluation(
                    cfg, eval_base, tokenizer, max_seq_len, eval_sets,
                    RewardRunner.from_config(cfg, data.task_dataset), eval_mode,
                )  # fmt: skip
                del eval_base
            elif eval_sets:
                log.info("evaluation on the rollout engines, between steps (training waits for it)")
            if cfg.debug.fault_inject:
                run.faults = FaultInjector(cfg.debug.fault_inject, run_dir)
                run.faults.bind(executor.trainer, executor.rollout, rewards)
            if cfg.speculative.draft_model:
                run.speculation = OnlineDraft(
                    cfg.speculative,
                    executor.rollout,
                    draft,
                    lambda: rebuild_draft(run),
                    lambda: trained_policy(run),
                )
            return run_loop(run)
        finally:
            if own_eval is not None:
                own_eval.close()
            executor.rollout.shutdown()  # Ray: stop the actors, free the placement group
    finally:
        rewards.close()
        if mode is not None:
            mode.close()


def engine_context(cfg: RunConfig, data: RunData, tokenizer, context: int, mode: RolloutMode | None) -> int:
    """The engines' max_seq_len: the longest prompt (with what a rollout mode adds) plus the
    response budget, within the model's context; a multi-turn mode learns it too."""
    overhead = mode.prompt_overhead(tokenizer) if mode is not None else 0
    if overhead is not None:  # e.g. the tools' descriptions
        data.max_prompt_len += overhead
    max_seq_len = min(context, data.max_prompt_len + cfg.rollout.rollout_max_response_len + 1)
    if overhead is None:  # an agent writes its own prompts
        max_seq_len = context
    if mode is not None and hasattr(mode, "max_seq_len"):  # conversations stop before they outgrow it
        mode.max_seq_len = max_seq_len
    return max_seq_len


def run_loop(run: Run) -> Path:
    """Rollout, train, sync, evaluate, log, checkpoint: `--num-rollout` times."""
    with logging_redirect_tqdm([log]):  # warnings go above the progress bar, not onto its line
        return _run_steps(run)


def _run_steps(run: Run) -> Path:
    cfg = run.cfg
    log.debug("weight sync: %s, every %d rollout(s)", run.sync.name, cfg.sync.update_weights_interval)
    start, resumed = resume(cfg, run.policy, run.trainer, run.sync, run.data, run.metrics, run.critic)
    log_memory_at_start(run)
    last_eval = float("nan")
    feed = RolloutFeed(run)
    own = run.own_eval
    if start == 0 and run.eval_sets:
        if own is not None:
            own.submit(run.trainer, -1)
        else:
            initial = feed.evaluate()
            run.metrics.log(-1, initial)
            last_eval = initial.get("eval_accuracy", last_eval)
    elif own is not None and (pending := resumed.get("eval_pending")) is not None:
        if not run.metrics.has(pending, "eval_"):  # stopped before that evaluation was logged
            own.submit(run.trainer, pending)
    feed.load_state_dict(resumed)
    if run.speculation is not None:
        if resumed and not carries_mode_state(resumed) and run.speculation.trainer is not None:
            log.warning(
                "the checkpoint is of an older format (no online draft state): the draft restarts from its file"
            )
        run.speculation.load_state_dict(resumed.get("draft"))
    profiler = StepProfiler(
        Path(cfg.logging.profile_dir or run.run_dir / "profile") if cfg.logging.profile else None,
        steps=cfg.rollout.num_rollout - start,
    )
    total = cfg.rollout.num_rollout
    bar = tqdm(
        range(start, total),
        "miles train",
        total,
        unit="step",
        initial=start,
        disable=not cfg.logging.progress,
    )
    for rollout_id in bar:
        precision = switch_precision(run, rollout_id)
        t0 = time.perf_counter()
        with profiler.phase("miles.rollout"):
            reach(run, "rollout", rollout_id)
            groups, step = feed.next(rollout_id)
        t1 = time.perf_counter()
        if groups and not cfg.debug.debug_rollout_only:
            step.update(train_and_sync(run, groups, rollout_id, profiler))
        if run.speculation is not None:
            step.update(run.speculation.step(rollout_id, [s for g in groups for s in g]))
        t2 = time.perf_counter()
        step.update(
            rollout_time=t1 - t0, train_time=t2 - t1, step_time=t2 - t0, weight_version=run.rollout.weight_version,
            **memory_step(run), **precision,
        )  # fmt: skip
        last = rollout_id == total - 1
        if run.eval_sets and (last or due(cfg.data.eval_interval, rollout_id)):
            if own is not None:
                last_eval = log_evaluations(run, own.submit(run.trainer, rollout_id), last_eval)
            else:
                step.update(feed.evaluate())
        times = run.rollout.take_times() if isinstance(run.rollout, ReportsEngineTimes) else None
        if times is not None:  # the engines' prefill/decode split of their time
            step.update(times.metrics())
        log_step(run, rollout_id, step)
        if own is not None:
            last_eval = log_evaluations(run, own.ready(), last_eval)
        profiler.step()
        last_eval = step.get("eval_accuracy", last_eval)
        bar.set_postfix(
            reward=f"{step['reward_mean']:.2f}", acc=f"{step['accuracy']:.2f}", eval=f"{last_eval:.2f}",
            s=f"{step['step_time']:.1f}",
        )  # fmt: skip
        if cfg.checkpoint.save and (last or due(cfg.checkpoint.save_interval, rollout_id)):
            run.trainer.sync_policy()
            state = {"actor": run.trainer.state_dict(), **feed.state_dict()}
            if run.speculation is not None:
                state["draft"] = run.speculation.state_dict()
            if run.critic is not None:
                state["critic"] = run.critic.state_dict()
            if own is not None:
                state["eval_pending"] = own.pending()
            save_checkpoint(
                cfg.checkpoint.save, rollout_id, {"model": run.policy}, run.tokenizer, state,
                written=functools.partial(reach, run, "checkpoint", rollout_id),
            )  # fmt: skip
    if own is not None:  # the run ends with its last evaluation logged
        log_evaluations(run, own.ready(wait=True), last_eval)
    for done in (bar, profiler, feed, run.metrics):
        done.close()
    if cfg.checkpoint.save_hf:
        run.trainer.sync_policy()
        if cfg.lora.enabled:  # the PEFT adapter, or base + adapter merged
            export_lora(
                run.policy,
                cfg.checkpoint.save_hf,
                cfg.model.model,
                cfg.lora.lora_merge_on_export,
                run.tokenizer,
            )
        else:
            save_model(run.policy, cfg.checkpoint.save_hf, tokenizer=run.tokenizer)
    return run.run_dir


def reach(run: Run, point: str, rollout_id: int) -> None:
    """A point --fault-inject may name: its faults for this rollout fire here."""
    if run.faults is not None:
        run.faults.reach(point, rollout_id)


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


def trained_policy(run: Run):
    """The policy as trained so far (on Ray, the driver's copy brought up to rank 0's weights)."""
    run.trainer.sync_policy()
    return run.policy


def rebuild_draft(run: Run):
    """--reinit-draft-interval: the draft built again, from the policy as trained so far (auto) or
    from its checkpoint."""
    run.trainer.sync_policy()
    return load_draft(run.cfg.speculative, run.policy, run.policy.lm_head.weight.device)


def switch_precision(run: Run, rollout_id: int) -> dict[str, float]:
    """--warmup-precision bf16: the FP8/INT4 layers of the trainer and the engines compute in bf16
    for the first --warmup-steps rollouts, then in FP8/INT4 (the switch is logged; `fp8_enabled` or
    `int4_enabled` marks each step). A run resumed past the warm-up switches at its first step."""
    kind = low_precision(run.cfg)
    if kind is None:
        return {}
    mode = mode_at(run.cfg, rollout_id)
    if mode != run.precision_mode:
        if run.precision_mode or mode != start_mode(run.cfg):
            run.trainer.set_precision(mode)
            if isinstance(run.rollout, SwitchesPrecision):  # SGLang servers keep their own precision
                run.rollout.set_precision(mode)
            # the engines re-quantize from the trainer's fp32 weights, not from what they held
            run.sync.push(run.rollout.weight_version)
            log.info("rollout %d: %s layers now compute in %s", rollout_id, kind.upper(), mode)
        run.precision_mode = mode
    return {f"{kind}_enabled": float(mode == kind)}


def due(interval: int, rollout_id: int) -> bool:
    """Whether an every-`interval`-rollouts action (0: never) falls after `rollout_id`."""
    return bool(interval) and (rollout_id + 1) % interval == 0


class RolloutFeed:
    """Each step's groups: generated now, or (--async-weight-sync) generated on a background
    thread while the previous step trained, one step off-policy. Colocated runs hand the devices
    to the engines here and take them back for training."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        self.run, self.cfg = run, cfg
        self.draw = cfg.rollout.over_sampling_batch_size or cfg.rollout.rollout_batch_size
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout")
            if cfg.sync.async_weight_sync
            else None
        )
        self.ahead = None  # with --async-weight-sync: the next rollout, already running
        self.partial = PartialRollout(cfg) if cfg.rollout.partial_rollout else None
        self.routing = None  # --r3-buffer-size: routing records wait here, bounded and compact
        if cfg.algo.r3_buffer_size is not None:
            from miles.rollout.routing_buffer import RoutingBuffer

            self.routing = RoutingBuffer(cfg.algo.r3_buffer_size, run.policy.config.num_experts or 0)

    def _collect(self, rollout_id: int):
        # prompts are taken when the rollout starts, in order, so checkpoints know the position
        run, debug = self.run, self.cfg.debug
        if debug.debug_train_only:
            return load_rollout(debug.load_debug_rollout_data, rollout_id)
        if self.partial is not None:
            groups, step = self.partial.collect(
                run.rollout, run.data.train.take, run.rewards, rollout_id, run.keep
            )
        else:
            groups, step = collect_groups(
                run.rollout,
                run.data.train.take(self.draw),
                self.cfg,
                run.rewards,
                rollout_id,
                run.keep,
                run.mode,
            )
        if debug.save_debug_rollout_data:
            save_rollout(debug.save_debug_rollout_data, rollout_id, groups, step)
        if self.routing is not None:
            self.routing.store(s for g in groups for s in g)
        return groups, step

    def next(self, rollout_id: int) -> tuple[list, dict]:
        run, cfg = self.run, self.cfg
        if self.pool is not None:
            groups, step = (self.ahead or self.pool.submit(self._collect, rollout_id)).result()
            more = rollout_id + 1 < cfg.rollout.num_rollout
            self.ahead = self.pool.submit(self._collect, rollout_id + 1) if more else None
            groups, step["stale_dropped"] = drop_stale(groups, rollout_id, cfg.sync.max_staleness)
        elif cfg.sync.colocate:  # the engines get the devices for the rollout, the trainer after it
            offloaded = run.trainer.offload()
            groups, step = self._collect(rollout_id)
            step["rollout_memory_released_bytes"] = run.rollout.release_memory()
            step["train_offloaded_bytes"] = offloaded
            run.trainer.onload()
        else:
            groups, step = self._collect(rollout_id)
        if self.routing is not None:  # this step's records leave the buffer for training
            self.routing.take((s for g in groups for s in g), in_flight=self.in_flight)
            step.update(self.routing.metrics())
        if run.trainer.world > 1:
            groups, step["groups_dropped_for_ranks"] = fit_to_ranks(groups, run.trainer.world)
        step["train_samples"] = sum(len(g) for g in groups)
        step["engine_restarts"] = run.rollout.restarts
        return groups, step

    @property
    def in_flight(self) -> int:
        """Samples whose records may wait at once: one rollout's, two with a rollout running ahead."""
        rollout = self.cfg.rollout
        per_rollout = self.draw * rollout.n_samples_per_prompt
        return per_rollout * (2 if self.pool is not None else 1)

    def evaluate(self) -> dict[str, float]:
        """Every evaluation set's metrics; with a rollout running ahead, after it, on its thread
        (the engine serves one caller at a time)."""
        run = self.run
        args = (run.rollout, run.eval_sets, self.cfg, run.rewards, run.mode)
        out = evaluate_all(*args) if self.pool is None else self.pool.submit(evaluate_all, *args).result()
        if run.speculation is not None:  # the spec_* metrics of a step count its own rollout only
            run.rollout.take_spec_stats()
        return out

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as if never stopped: the prompt position, the rollout
        running ahead (waited for: it is the next step's, generated by the weights before this
        step's update) and the partial groups carried to the next rollout."""
        state = {"data_position": self.run.data.train.position}
        if self.ahead is not None:
            state["ahead"] = self.ahead.result()
        if self.partial is not None:
            state["partial"] = self.partial.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what the checkpoint carries; what it carries and this run cannot use (another
        mode), or what this run needs and it lacks (an older checkpoint), is said once."""
        for key, flag, here in (
            ("ahead", "--async-weight-sync", self.pool),
            ("partial", "--partial-rollout", self.partial),
        ):
            if state.get(key) is not None and here is None:
                log.warning(
                    "the checkpoint holds %s (a %s run); this run, without %s, does not use it",
                    "a rollout generated ahead" if key == "ahead" else "partial groups carried over",
                    flag,
                    flag,
                )
            elif state and not carries_mode_state(state) and here is not None:
                log.warning(
                    "the checkpoint is of an older format (no %s state): the resumed %s run generates its next "
                    "rollout afresh, so it will not equal a run that was never stopped",
                    key,
                    flag,
                )
        if state.get("ahead") is not None and self.pool is not None:
            done: Future = Future()
            done.set_result(state["ahead"])
            self.ahead = done
            if self.routing is not None:
                self.routing.store(s for g in state["ahead"][0] for s in g)
        if state.get("partial") is not None and self.partial is not None:
            self.partial.load_state_dict(state["partial"])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def train_and_sync(run: Run, groups: list, rollout_id: int, profiler: StepProfiler) -> dict[str, float]:
    """Advantages and one rollout of training, then (every --update-weights-interval) the weights
    to the engines. Stops the run when training cannot go on: too many skipped steps, or
    --verify-logprobs finding trainer and engine apart."""
    cfg = run.cfg
    reward_kl: list[float] = []

    def reference_kl(samples):  # REINFORCE++'s KL penalty, also logged as reward_kl_mean
        kl = run.trainer.reference_kl(samples)
        reward_kl.append(float(torch.cat(kl).mean()) if kl else 0.0)
        return kl

    with profiler.phase("miles.train"):
        reach(run, "step", rollout_id)
        samples = [s for g in groups for s in g]
        if due(cfg.debug.mismatch_dump_interval, rollout_id):  # before training: the generating weights
            dump_for_localization(run, samples, rollout_id)
        if run.critic is not None:
            metrics = train_with_critic(run, samples, rollout_id, reference_kl)
            if rollout_id < cfg.algo.critic_warmup:
                return metrics  # the policy did not change: nothing to sync
        else:
            advantages = compute_advantages(groups, cfg, reference_kl)
            opd = {}
            if cfg.algo.use_opd:  # the teacher's log-probs of the policy's own tokens (and its top-k)
                algo = cfg.algo
                topk = algo.opd_topk
                teacher = (
                    TeacherServer(algo.opd_teacher_url, cfg.rollout.rollout_temperature, topk).logprobs(
                        samples
                    )
                    if algo.opd_teacher_url
                    else run.trainer.teacher_logprobs(samples, topk)
                )
                advantages, opd = distill(
                    advantages, samples, teacher, algo.opd_kl_coef, algo.opd_type == "advantage"
                )
            metrics = {**run.trainer.train(samples, advantages), **opd}
    if reward_kl:
        metrics["reward_kl_mean"] = reward_kl[0]
    check_training(cfg, metrics, rollout_id)
    if due(cfg.sync.update_weights_interval, rollout_id):
        with profiler.phase("miles.sync"):
            reach(run, "sync", rollout_id)
            sync = run.sync.push(rollout_id + 1)
        metrics.update(
            sync_buckets=sync.buckets, sync_moved_bytes=sync.moved_bytes, sync_seconds=sync.seconds
        )
        log.debug(
            "rollout %d: weight sync v%d: %d tensors in %d buckets, %d bytes moved, %.3f s",
            rollout_id, rollout_id + 1, sync.tensors, sync.buckets, sync.moved_bytes, sync.seconds,
        )  # fmt: skip
    return metrics


def dump_for_localization(run: Run, samples: list, rollout_id: int) -> None:
    """--mismatch-dump-interval: this rollout's first samples with the trainer's weights and the
    engine's served ones, for `miles doctor --localize-mismatch`."""
    run.trainer.sync_policy()
    engine = run.rollout.states()[0] if isinstance(run.rollout, ReadsWeightsBack) else None
    kept = samples[: run.cfg.debug.mismatch_dump_samples]
    save_dump(run.run_dir, rollout_id, kept, run.policy.state_dict(), engine)


def train_with_critic(run: Run, samples: list, rollout_id: int, reference_kl) -> dict[str, float]:
    """PPO: GAE advantages from the critic's values (before either model changes), then the critic's
    step on the returns and, after --critic-warmup rollouts, the policy's."""
    kl = reference_kl(samples) if run.cfg.algo.kl_coef > 0 else None
    advantages, returns, values = run.critic.advantages(samples, kl)
    metrics = run.critic.train(samples, returns, values)
    if rollout_id >= run.cfg.algo.critic_warmup:
        metrics.update(run.trainer.train(samples, advantages))
    return metrics


def memory_step(run: Run) -> dict[str, float]:
    """Peak memory of the step: this process, and the training ranks and engines where they
    have processes of their own (the largest of each)."""
    out = memory_metrics("driver", [step_peak_memory(run.policy.lm_head.weight.device)])
    for role, per_process in (("train", run.trainer.peak_memory()), ("rollout", run.rollout.peak_memory())):
        if per_process:
            out.update(memory_metrics(role, per_process))
    return out


def log_memory_at_start(run: Run) -> None:
    """Where memory goes before the first step: a training rank's weights/grads/optimizer state
    and an engine's weights by dtype (the per-step figures are the `mem_*` metrics)."""
    for role, per_process in (("trainer", run.trainer.peak_memory()), ("engine", run.rollout.peak_memory())):
        if per_process:
            report = {k: v for k, v in per_process[0].items() if not k.startswith(("peak_rss", "cuda_max"))}
            log.info("memory at start, one %s: %s", role, describe_bytes(report) or "nothing held yet")


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


def log_evaluations(run: Run, finished: list[tuple[int, dict[str, float]]], last_eval: float) -> float:
    """Log --eval-engine own's finished evaluations, each under the step it evaluates; the
    latest eval_accuracy (for the progress bar)."""
    for rollout_id, figures in finished:
        run.metrics.log(rollout_id, figures)
        last_eval = figures.get("eval_accuracy", last_eval)
    return last_eval


def log_step(run: Run, rollout_id: int, step: dict) -> None:
    if log.isEnabledFor(logging.DEBUG):
        mismatch = [
            f"{k}={v:.4g}" for k, v in step.items() if k.startswith(("train_rollout", "tis_", "routing_"))
        ]
        log.debug(
            "rollout %d: rollout %.2f s, train+sync %.2f s; rewards failed %d; mismatch: %s",
            rollout_id, step["rollout_time"], step["train_time"], step.get("reward_failed", 0),
            ", ".join(mismatch) or "-",
        )  # fmt: skip
    run.metrics.log(rollout_id, step)


def drop_stale(groups, trainer_version: int, bound: int):
    """Record each sample's staleness (trainer version - oldest weight version it was generated
    with) and drop the groups holding a sample staler than `bound`; returns (groups, dropped)."""
    kept = []
    for group in groups:
        for s in group:
            s.metadata["staleness"] = trainer_version - min(s.weight_versions or [trainer_version])
        if all(s.metadata["staleness"] <= bound for s in group):
            kept.append(group)
    return kept, len(groups) - len(kept)


def fit_to_ranks(groups: list, world: int) -> tuple[list, int]:
    """Drop whole groups from the end until the samples split evenly over `world` ranks (a
    dynamic-sampling filter or the staleness bound can leave any count); returns (groups, dropped)."""
    kept = list(groups)
    while kept and sum(len(g) for g in kept) % world:
        kept.pop()
    return kept, len(groups) - len(kept)
