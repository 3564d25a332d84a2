"""The RL loop, local executor: rollout, reward, advantages, train, push weights, log, eval, save.

Everything runs in this process: the trainer's model and the engine's model are separate copies
of the same `miles.models` code, and weights move between them by `engine.update_weights`, as
they would between processes.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from miles.algo import advantages as adv_lib
from miles.algo.filters import nonconstant_reward
from miles.config import to_dict
from miles.config.schema import RunConfig
from miles.errors import ConfigError, MilesError
from miles.models import registry
from miles.models.checkpoint import hf_state_dict, save_model
from miles.rewards.functions import load_function
from miles.rewards.runner import RewardRunner
from miles.rollout.engine import Engine
from miles.rollout.rollout import generate_groups, rollout
from miles.runtime.checkpoint import clear_stale, load_latest, save_checkpoint
from miles.runtime.metrics import MetricsLogger
from miles.runtime.profiling import StepProfiler
from miles.runtime.setup import build_data, resolve_device, run_dir_for
from miles.sync.buckets import checksum
from miles.sync.transports import (
    BucketBuffer,
    SyncStats,
    send_bucketed,
    send_shared,
    share,
    shared_memory_available,
)
from miles.train.policy_trainer import PolicyTrainer

log = logging.getLogger("miles")


def compute_advantages(groups, cfg: RunConfig, actor: PolicyTrainer) -> list[torch.Tensor]:
    """Per-token advantages for each sample, in group order."""
    a, n = cfg.algo, cfg.rollout.n_samples_per_prompt
    samples = [s for g in groups for s in g]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    lengths = [s.response_length for s in samples]
    if a.advantage_estimator in ("grpo", "gspo"):
        per_sample = adv_lib.grpo(rewards, n, std_normalize=not a.disable_grpo_std_normalization)
    elif a.advantage_estimator == "rloo":
        per_sample = adv_lib.rloo(rewards, n)
    else:  # reinforce_plus_plus(_baseline): per token, with the KL penalty in the reward
        T = max(lengths)
        mask = torch.tensor([[1.0] * n_ + [0.0] * (T - n_) for n_ in lengths])
        kl = torch.zeros_like(mask)
        if a.kl_coef > 0 and actor is not None:
            for i, d in enumerate(actor.reference_kl(samples)):
                kl[i, : len(d)] = d
        if a.advantage_estimator == "reinforce_plus_plus":
            tok = adv_lib.reinforce_plus_plus(rewards, kl, mask, a.kl_coef, a.gamma)
        else:
            tok = adv_lib.reinforce_plus_plus_baseline(rewards, n, kl, mask, a.kl_coef, a.gamma)
        return [tok[i, :L] for i, L in enumerate(lengths)]
    if a.normalize_advantages:
        mask = torch.tensor([[1.0] * L + [0.0] * (max(lengths) - L) for L in lengths])
        tok = adv_lib.whiten(adv_lib.to_tokens(per_sample, mask), mask)
        return [tok[i, :L] for i, L in enumerate(lengths)]
    return [per_sample[i].expand(L) for i, L in enumerate(lengths)]


def evaluate(engine: Engine, items, cfg: RunConfig, rewards: RewardRunner) -> dict[str, float]:
    """Greedy answers to the held-out prompts: accuracy (reward 1) and mean reward."""
    groups = generate_groups(engine, items, cfg, rollout_id=-1, n=1, temperature=0.0, seed_base=0)
    rewards.score_groups(groups)
    samples = [g[0] for g in groups]
    return {
        "eval_accuracy": sum(s.reward >= 1.0 for s in samples) / len(samples),
        "eval_reward": sum(s.reward for s in samples) / len(samples),
    }


def push_weights(
    policy,
    engine: Engine,
    version: int,
    bucket_bytes: int,
    check_equal: bool,
    staging: BucketBuffer | None = None,
    zero_copy: bool = False,
    trainer=None,
    broadcast_from=None,
) -> SyncStats:
    """Send the policy's HF-named tensors to the engine: with `zero_copy`, handles to its shared
    memory; else checksummed buckets of at most `bucket_bytes`. Training ranks on Ray
    (`trainer.publish`) hand their buckets to Ray engines directly, and the driver's `policy` is
    refreshed only where it is read. `broadcast_from` (--sync-transport broadcast): the trainer
    side of the weight-update group with the Ray engines. With `check_equal`, compare checksums
    of engine and trainer weights after."""
    t0 = time.perf_counter()
    state = None  # the driver's HF tensors, when a path below needed them
    blob = trainer.share_handles() if zero_copy and hasattr(trainer, "share_handles") else None
    if broadcast_from is not None:
        stats = engine.update_weights_by_broadcast(broadcast_from, version, bucket_bytes)
        stats.seconds = time.perf_counter() - t0
    elif blob is not None and hasattr(engine, "update_weights_from_handles"):
        # engines map rank 0's own shared memory: nothing passes through the driver
        engine.update_weights_from_handles(blob, version)
        payload = sum(t.numel() * t.element_size() for t in policy.parameters())
        stats = SyncStats(0, 1, payload, len(blob), time.perf_counter() - t0)
    elif hasattr(trainer, "publish") and hasattr(engine, "update_weights_from_buckets") and not zero_copy:
        buckets = trainer.publish(bucket_bytes)
        engine.update_weights_from_buckets(buckets, version)
        payload = sum(meta.nbytes for meta, _ in buckets)
        tensors = sum(len(meta.tensors) for meta, _ in buckets)
        stats = SyncStats(tensors, len(buckets), payload, payload, time.perf_counter() - t0)
    else:
        if trainer is not None:
            trainer.sync_policy()
        state = hf_state_dict(policy)
        if zero_copy:
            stats = send_shared(list(state.items()), engine, version)
        elif isinstance(engine, Engine):
            with engine.paused():  # every bucket lands before the next decoding step (async rollouts)
                stats = send_bucketed(state.items(), engine, version, bucket_bytes, staging=staging)
        else:  # Ray engines: the manager buckets one whole update, so a restarted actor gets all of it
            n = engine.update_weights(state.items(), version, bucket_bytes)
            payload = sum(t.numel() * t.element_size() for t in state.values())
            stats = SyncStats(len(state), n, payload, payload, time.perf_counter() - t0)
    if check_equal:
        if state is None:  # the direct Ray paths did not read the driver's copy: refresh it
            trainer.sync_policy()
            state = hf_state_dict(policy)
        engine_states = engine.states() if hasattr(engine, "states") else [engine.model.state_dict()]
        differ = sorted(
            {n for es in engine_states for n, t in state.items() if checksum(es[n]) != checksum(t)}
        )
        if differ:
            raise MilesError(
                f"--check-weight-update-equal: engine weights differ from the trainer's after sync: {differ[:5]}"
            )
    return stats


def ray_hosts(trainer, engine) -> int:
    """How many Ray nodes the driver, training rank 0 and the engine actors span (1 without Ray)."""
    if not hasattr(engine, "node_ids"):
        return 1
    import ray

    nodes = {ray.get_runtime_context().get_node_id(), *engine.node_ids()}
    if hasattr(trainer, "node_id"):
        nodes.add(trainer.node_id())
    return len(nodes)


def broadcast_source(cfg: RunConfig, trainer, engine):
    """The trainer side of the weight-update group when weights go to Ray engines by broadcast
    (--sync-transport; auto picks it for disaggregated GPUs), else None."""
    from miles.runtime.ray_rollout import RolloutManager

    choice = cfg.sync.sync_transport
    if not isinstance(engine, RolloutManager):
        if choice == "broadcast":
            log.warning(
                "--sync-transport broadcast: the engine runs in this process; weights are copied directly"
            )
        return None
    on_gpu = engine.placement is not None and engine.placement.use_gpu
    if on_gpu and cfg.sync.colocate:  # NCCL refuses two ranks on one GPU
        if choice == "broadcast":
            log.warning(
                "--sync-transport broadcast with --colocate on GPUs: NCCL cannot join a rank and an engine "
                "on the same GPU; using the object store (--use-zero-copy-sync maps the weights instead)"
            )
        return None
    if choice == "object-store" or (choice == "auto" and not on_gpu):
        return None
    return trainer


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


def build_executor(cfg: RunConfig, policy, tokenizer, max_seq_len: int):
    """(trainer, engine): in this process, or on Ray when more than one training rank or rollout
    engine is asked for (--actor-num-nodes x --actor-num-gpus-per-node, --rollout-num-gpus;
    processes on CPU), in one placement group (see `miles.runtime.placement`)."""
    sy, r = cfg.sync, cfg.rollout
    ranks, devices = sy.actor_num_nodes * sy.actor_num_gpus_per_node, sy.rollout_num_gpus or 1
    tp = sy.rollout_num_gpus_per_engine
    if ranks == 1 and devices == 1:  # one process: trainer and engine share its device
        policy.to(resolve_device(cfg.model.device))
        engine = Engine(
            copy.deepcopy(policy),
            tokenizer,
            r.rollout_max_batch_size,
            max_seq_len=max_seq_len,
            seed=r.rollout_seed,
        )
        return PolicyTrainer(policy, cfg), engine
    from miles.runtime.placement import create_placement, plan_layout
    from miles.runtime.ray_rollout import RolloutManager
    from miles.runtime.ray_train import RayTrainer

    if tp > 1:
        from miles.models.tensor_parallel import check_divisible

        check_divisible(policy, tp)  # before any actor starts
    placement = create_placement(plan_layout(ranks, devices, sy.colocate), cfg.model.device)
    layout = placement.layout
    log.debug("placement on Ray (device %s): %s", cfg.model.device, layout)
    manager = RolloutManager(
        cfg.model.model,
        devices // tp,
        r.rollout_max_batch_size,
        max_seq_len,
        r.rollout_seed,
        actor_options=[placement.options(b) for b in layout.rollout_bundles],
        tp_size=tp,
        device=cfg.model.device,
    )
    # training runs in actors even for one rank: each gets its own device from its bundle (a
    # driver on "cuda:0" could share a GPU with an engine, and NCCL refuses two ranks on one GPU)
    trainer = RayTrainer(cfg, policy, ranks, [placement.options(b) for b in layout.train_bundles])
    manager.placement = placement  # freed with the engines (training ranks die with it)
    manager.update_weights(hf_state_dict(policy).items(), version=0)  # the engines start from the policy
    return trainer, manager


def train(cfg: RunConfig) -> Path:
    context = registry.context_length(cfg.model.model)
    if cfg.rollout.rollout_max_response_len >= context:
        raise ConfigError(
            f"--rollout-max-response-len {cfg.rollout.rollout_max_response_len} does not fit the context of "
            f"--model {cfg.model.model} ({context} tokens, prompt included); use less than {context}"
        )
    torch.manual_seed(cfg.train.seed)
    policy, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)
    if tokenizer is None:
        raise MilesError(
            f"--model {cfg.model.model}: the checkpoint has no tokenizer (tokenizer.json); training needs one"
        )
    data = build_data(cfg)
    rewards = RewardRunner(
        cfg.reward.rm_type,
        cfg.reward.custom_rm_path,
        cfg.reward.group_rm,
        cfg.reward.reward_timeout,
        data.task_dataset,
        cfg.reward.reward_num_workers,
    )
    keep = None
    if cfg.rollout.dynamic_sampling_filter_path:
        p = cfg.rollout.dynamic_sampling_filter_path
        keep = nonconstant_reward if p == "default" else load_function(p, "--dynamic-sampling-filter-path")
    max_seq_len = min(
        policy.config.max_position_embeddings, data.max_prompt_len + cfg.rollout.rollout_max_response_len + 1
    )
    try:
        actor, engine = build_executor(cfg, policy, tokenizer, max_seq_len)
        try:
            return run_loop(cfg, policy, tokenizer, data, rewards, keep, actor, engine)
        finally:
            if hasattr(engine, "shutdown"):  # Ray: stop the actors, free the placement group
                engine.shutdown()
    finally:
        rewards.close()


def resume(cfg: RunConfig, policy, actor, engine, data, metrics: MetricsLogger) -> int:
    """The first rollout to run: after the latest checkpoint of --load (model, optimizer, data
    position and engine weights restored, later metrics dropped), else 0 (old metrics moved aside)."""
    for d in (cfg.checkpoint.save, cfg.checkpoint.load):
        if d:
            clear_stale(d)
    if cfg.checkpoint.load and (loaded := load_latest(cfg.checkpoint.load, policy)) is not None:
        ckpt, state = loaded
        actor.load_state_dict(state["actor"])
        data.train.position = state["data_position"]
        engine.update_weights(hf_state_dict(policy).items(), version=state["rollout_id"] + 1)
        metrics.truncate_after(state["rollout_id"])
        log.info("resumed from %s at rollout %d", ckpt, state["rollout_id"] + 1)
        return state["rollout_id"] + 1
    metrics.archive_previous()
    return 0


def train_step(cfg: RunConfig, groups, rollout_id: int, actor) -> dict[str, float]:
    """Advantages and one rollout of training; stops the run when --verify-logprobs finds the
    trainer and the engine disagree."""
    samples = [s for g in groups for s in g]
    metrics = actor.train(samples, compute_advantages(groups, cfg, actor))
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
    return metrics


def run_loop(cfg: RunConfig, policy, tokenizer, data, rewards: RewardRunner, keep, actor, engine) -> Path:
    """Rollout, train, sync, log, evaluate, checkpoint: `cfg.rollout.num_rollout` times."""
    zero_copy = cfg.sync.use_zero_copy_sync
    if zero_copy and not shared_memory_available():
        log.warning(
            "--use-zero-copy-sync: shared memory is not available here; using the standard bucketed sync"
        )
        zero_copy = False
    hosts = ray_hosts(actor, engine) if zero_copy else 1
    if hosts > 1:
        log.warning(
            "--use-zero-copy-sync: the trainer and the rollout engines are on %d hosts, and memory handles only "
            "open on the host that made them; using the standard sync",
            hosts,
        )
        zero_copy = False
    if zero_copy:
        share(hf_state_dict(policy).items())  # the policy's weights now live in shared memory
    run_dir = run_dir_for(cfg)
    metrics = MetricsLogger(
        run_dir, cfg.logging.use_tensorboard, cfg.logging.use_wandb, cfg.logging.wandb_project, to_dict(cfg)
    )
    staging = BucketBuffer()  # one weight-sync staging buffer for the whole run
    broadcast_from = None if zero_copy else broadcast_source(cfg, actor, engine)  # zero-copy first
    transport = (
        "zero-copy (shared memory handles)"
        if zero_copy
        else "broadcast over the weight-update group"
        if broadcast_from is not None
        else f"buckets of {cfg.sync.sync_bucket_size} bytes"
    )
    log.debug("weight sync: %s, every %d rollout(s)", transport, cfg.sync.update_weights_interval)
    start = resume(cfg, policy, actor, engine, data, metrics)
    last_eval = float("nan")
    if start == 0 and data.eval_items:
        initial = evaluate(engine, data.eval_items, cfg, rewards)
        metrics.log(-1, initial)
        last_eval = initial["eval_accuracy"]
    bar = tqdm(
        range(start, cfg.rollout.num_rollout),
        desc="miles train",
        unit="step",
        disable=not cfg.logging.progress,
        initial=start,
        total=cfg.rollout.num_rollout,
    )
    draw = cfg.rollout.over_sampling_batch_size or cfg.rollout.rollout_batch_size
    pool = (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout")
        if cfg.sync.async_weight_sync
        else None
    )
    ahead = None  # with --async-weight-sync: the next rollout, already running

    def start_rollout(rid: int):  # prompts are taken here, in order, so checkpoints know the position
        return pool.submit(rollout, engine, data.train.take(draw), cfg, rewards, rid, keep)

    profiler = StepProfiler(
        Path(cfg.logging.profile_dir or run_dir / "profile") if cfg.logging.profile else None
    )
    for rollout_id in bar:
        t0 = time.perf_counter()
        colocated = cfg.sync.colocate and pool is None
        offloaded = actor.offload() if colocated else 0  # the engines get the devices for rollout
        with profiler.phase("miles.rollout"):
            if pool is None:
                groups, step = rollout(engine, data.train.take(draw), cfg, rewards, rollout_id, keep)
            else:
                groups, step = (ahead or start_rollout(rollout_id)).result()
                ahead = start_rollout(rollout_id + 1) if rollout_id + 1 < cfg.rollout.num_rollout else None
                groups, step["stale_dropped"] = drop_stale(
                    groups, trainer_version=rollout_id, bound=cfg.sync.max_staleness
                )
        t1 = time.perf_counter()
        if colocated:  # training has the devices now: engines free their KV cache, the trainer returns
            step["rollout_memory_released_bytes"] = engine.release_memory()
            step["train_offloaded_bytes"] = offloaded
            actor.onload()
        if getattr(actor, "world", 1) > 1:
            groups, step["groups_dropped_for_ranks"] = fit_to_ranks(groups, actor.world)
        step["train_samples"] = sum(len(g) for g in groups)
        if hasattr(engine, "restarts"):  # Ray engines restarted so far (each redid its requests)
            step["engine_restarts"] = engine.restarts
        if groups and not cfg.debug.debug_rollout_only:
            with profiler.phase("miles.train"):
                step.update(train_step(cfg, groups, rollout_id, actor))
            if (rollout_id + 1) % cfg.sync.update_weights_interval == 0:
                with profiler.phase("miles.sync"):
                    sync = push_weights(
                        policy,
                        engine,
                        rollout_id + 1,
                        cfg.sync.sync_bucket_size,
                        cfg.sync.check_weight_update_equal,
                        staging,
                        zero_copy,
                        trainer=actor,
                        broadcast_from=broadcast_from,
                    )
                step.update(
                    sync_buckets=sync.buckets, sync_moved_bytes=sync.moved_bytes, sync_seconds=sync.seconds
                )
                log.debug(
                    "rollout %d: weight sync v%d: %d tensors in %d buckets, %d bytes moved, %.3f s",
                    rollout_id, rollout_id + 1, sync.tensors, sync.buckets, sync.moved_bytes, sync.seconds,
                )  # fmt: skip
        t2 = time.perf_counter()
        step.update(
            rollout_time=t1 - t0, train_time=t2 - t1, step_time=t2 - t0, weight_version=engine.weight_version
        )
        last = rollout_id == cfg.rollout.num_rollout - 1
        if data.eval_items and (
            last or (cfg.data.eval_interval and (rollout_id + 1) % cfg.data.eval_interval == 0)
        ):
            if pool is None:
                step.update(evaluate(engine, data.eval_items, cfg, rewards))
            else:  # after the running rollout, on its thread: the engine serves one caller at a time
                step.update(pool.submit(evaluate, engine, data.eval_items, cfg, rewards).result())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rollout %d: rollout %.2f s, train+sync %.2f s; rewards failed %d; mismatch: %s",
                rollout_id, step["rollout_time"], step["train_time"], step.get("reward_failed", 0),
                ", ".join(
                    f"{k}={v:.4g}" for k, v in step.items() if k.startswith(("train_rollout", "tis_", "routing_mismatch"))
                ) or "-",
            )  # fmt: skip
        metrics.log(rollout_id, step)
        profiler.step()
        last_eval = step.get("eval_accuracy", last_eval)
        bar.set_postfix(
            reward=f"{step['reward_mean']:.2f}",
            acc=f"{step['accuracy']:.2f}",
            eval=f"{last_eval:.2f}",
            s=f"{step['step_time']:.1f}",
        )
        if cfg.checkpoint.save and (
            last or (cfg.checkpoint.save_interval and (rollout_id + 1) % cfg.checkpoint.save_interval == 0)
        ):
            actor.sync_policy()
            save_checkpoint(
                cfg.checkpoint.save,
                rollout_id,
                policy,
                tokenizer,
                {
                    "actor": actor.state_dict(),
                    "data_position": data.train.position - (draw if ahead is not None else 0),
                },
            )
    bar.close()
    profiler.close()
    if pool is not None:
        pool.shutdown()
    metrics.close()
    if cfg.checkpoint.save_hf:
        actor.sync_policy()
        save_model(policy, cfg.checkpoint.save_hf, tokenizer=tokenizer)
    return run_dir
