"""Building a run's trainer, rollout and weight sync: in this process, or on Ray.

One process when one training rank and one rollout device are asked for; otherwise training
ranks (`RayTrainer`) and engine actors (`RolloutManager`) in one Ray placement group
(`miles.runtime.placement`). Either way the loop gets the same three objects.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from miles.config.schema import RunConfig
from miles.devices import resolve_device
from miles.errors import ConfigError
from miles.models.checkpoint import hf_state_dict
from miles.quant.convert import check_at_start, prepare_rollout_model
from miles.rollout.debug_data import NoSync, ReplayRollout
from miles.rollout.drafts import speculator_for
from miles.rollout.engine import Engine
from miles.runtime.protocols import HostsDraft, ReadsWeightsBack, ReleasesMemory, Rollout, Trainer
from miles.sync.strategy import CheckedSync, WeightSync, weight_sync_for
from miles.train.policy_trainer import PolicyTrainer
from miles.train.prepare import prepare_train_model

log = logging.getLogger("miles")


@dataclass
class Executor:
    trainer: Trainer
    rollout: Rollout
    sync: WeightSync


def on_ray(cfg: RunConfig) -> bool:
    """Whether training and rollout run in Ray actors: more than one training rank or engine device."""
    sync_cfg = cfg.sync
    return (
        sync_cfg.actor_num_nodes * sync_cfg.actor_num_gpus_per_node > 1
        or (sync_cfg.rollout_num_gpus or 1) > 1
    )


def rollout_class(cfg: RunConfig) -> type:
    """The `Rollout` implementation a run's flags build."""
    if cfg.sglang.rollout_backend == "sglang":
        from miles.rollout.sglang_client import SGLangRollout

        return SGLangRollout
    if cfg.debug.debug_train_only:
        return ReplayRollout
    if on_ray(cfg):
        from miles.runtime.ray_rollout import RolloutManager

        return RolloutManager
    return Engine


def _implements(cls: type, capability: type) -> bool:
    return issubclass(cls, capability)  # the capabilities are runtime-checkable protocols of methods


# (whether the run asks for it, the capability its rollout needs, the flag that asks)
ROLLOUT_NEEDS = (
    (lambda cfg: cfg.sync.colocate, ReleasesMemory, "--colocate"),
    (lambda cfg: cfg.sync.check_weight_update_equal, ReadsWeightsBack, "--check-weight-update-equal"),
    (lambda cfg: cfg.lora.check_lora_weight_equal, ReadsWeightsBack, "--check-lora-weight-equal"),
    (lambda cfg: cfg.speculative.draft_model is not None, HostsDraft, "--draft-model"),
)


def check_capabilities(cfg: RunConfig) -> None:
    """Refuse, before anything is built, a flag whose capability the run's rollout lacks."""
    cls = rollout_class(cfg)
    for asked, capability, flag in ROLLOUT_NEEDS:
        if asked(cfg) and not _implements(cls, capability):
            what = (capability.__doc__ or capability.__name__).strip().rstrip(".")
            raise ConfigError(
                f"{flag} needs {what[0].lower() + what[1:]}; this run's rollout ({cls.__name__}) is not one"
            )


def build_executor(cfg: RunConfig, policy, tokenizer, max_seq_len: int, draft=None, teacher=None) -> Executor:
    """The trainer/rollout pair for --actor-num-nodes x --actor-num-gpus-per-node training ranks
    and --rollout-num-gpus engine devices, and the weight sync between them. `teacher`
    (--use-opd, one process only): the trainer's KL reference."""
    check_capabilities(cfg)
    if cfg.speculative.draft_model is not None and policy.config.is_vision_language:
        raise ConfigError(
            "--draft-model with a vision-language model: the drafts do not see images yet, so they would "
            "propose blind; drop --draft-model"
        )
    sync_cfg, rollout_cfg = cfg.sync, cfg.rollout
    ranks, devices = (
        sync_cfg.actor_num_nodes * sync_cfg.actor_num_gpus_per_node,
        sync_cfg.rollout_num_gpus or 1,
    )
    check_at_start(policy, cfg)
    if cfg.train.expert_model_parallel_size > 1:
        from miles.train.expert_parallel import check_experts

        check_experts(policy, cfg.train.expert_model_parallel_size)  # before any rank starts
    if cfg.sglang.rollout_backend == "sglang":
        return build_sglang_executor(cfg, policy, tokenizer, ranks)
    if on_ray(cfg):
        return build_ray_executor(cfg, policy, max_seq_len, ranks, devices)
    policy.to(resolve_device(cfg.model.device))  # one process: trainer and engine share its device
    if cfg.debug.debug_train_only:  # no engine: the samples come from saved rollouts (one process only)
        replay = ReplayRollout(tokenizer)
        return Executor(local_trainer(cfg, policy, teacher), replay, NoSync(replay))
    slots = rollout_cfg.rollout_max_batch_size
    speculator = speculator_for(cfg.speculative, policy, slots, max_seq_len, draft)
    engine = local_engine(cfg, copy.deepcopy(policy), tokenizer, max_seq_len, speculator)
    log.info("rollout engine decode step: %s", engine.decode_path)
    trainer = local_trainer(cfg, policy, teacher)
    return with_adapters_served(cfg, Executor(trainer, engine, weight_sync_for(sync_cfg, trainer, engine)))


def local_engine(cfg: RunConfig, model, tokenizer, max_seq_len: int, speculator=None) -> Engine:
    """An engine in this process over `model` (consumed: converted to the rollout's precision and
    moved to --device), with the run's batch size, seed and decode step: the rollout engine, and
    the engines that evaluate (`--eval-engine own`, `miles eval`)."""
    rollout_cfg = cfg.rollout
    served = prepare_rollout_model(model, cfg).to(resolve_device(cfg.model.device))
    return Engine(served, tokenizer, rollout_cfg.rollout_max_batch_size, max_seq_len=max_seq_len,
                  seed=rollout_cfg.rollout_seed, speculator=speculator, **rollout_cfg.engine_options())  # fmt: skip


def with_adapters_served(cfg: RunConfig, executor: Executor) -> Executor:
    """LoRA: the engines start from the base; the first sync gives them the starting adapter
    (read back after every sync with --check-lora-weight-equal)."""
    if cfg.lora.check_lora_weight_equal and not isinstance(executor.sync, CheckedSync):
        executor.sync = CheckedSync(executor.sync, executor.trainer, executor.rollout)
    if cfg.lora.enabled:
        executor.sync.push(0)
    return executor


def local_trainer(cfg: RunConfig, policy, reference=None) -> PolicyTrainer:
    """The trainer in this process, on --device (an in-process engine shares the device);
    `reference`: its KL reference when not a copy of the policy (the --use-opd teacher)."""
    device = resolve_device(cfg.model.device)
    policy.to(device)
    return PolicyTrainer(
        prepare_train_model(policy, cfg), cfg, reference.to(device) if reference is not None else None
    )


def build_sglang_executor(cfg: RunConfig, policy, tokenizer, ranks: int) -> Executor:
    """Training here (or on `ranks` Ray ranks), rollout on the SGLang servers of --sglang-url;
    the servers start from the trainer's weights (version 0), by --sglang-weight-transport."""
    from miles.rollout.sglang_client import SGLangRollout
    from miles.runtime.metrics import run_dir_for
    from miles.sync.strategy import ServerSync

    sg = cfg.sglang
    if on_ray(cfg):
        from miles.runtime.placement import create_placement, plan_layout
        from miles.runtime.ray_train import RayTrainer

        placement = create_placement(plan_layout(ranks, 0, False), cfg.model.device)
        trainer = RayTrainer(
            cfg, policy, ranks, [placement.options(b) for b in placement.layout.train_bundles]
        )
    else:
        trainer = local_trainer(cfg, policy)
    rollout = SGLangRollout(
        [u.strip() for u in sg.sglang_url.split(",") if u.strip()],
        tokenizer,
        policy.config,
        sg.sglang_weight_dir or run_dir_for(cfg) / "sglang_weights",
        max_concurrency=sg.sglang_max_concurrency,
        retries=sg.sglang_retries,
        timeout=sg.sglang_request_timeout,
        transport=sg.sglang_weight_transport,
        master_address=sg.sglang_master_address,
    )
    if on_ray(cfg):
        rollout.placement = placement  # freed by its shutdown (the training ranks die with it)
    sync = ServerSync(trainer, rollout)
    if cfg.sync.check_weight_update_equal or cfg.lora.check_lora_weight_equal:
        sync = CheckedSync(sync, trainer, rollout)
    sync.push(0)
    log.info(
        "rollout on SGLang servers %s (%s)", rollout.node_ids(), ", ".join(rollout.server_versions.values())
    )
    return Executor(trainer, rollout, sync)


def build_ray_executor(cfg: RunConfig, policy, max_seq_len: int, ranks: int, devices: int) -> Executor:
    import ray

    from miles.runtime.placement import create_placement, plan_layout
    from miles.runtime.ray_rollout import RolloutManager
    from miles.runtime.ray_train import RayTrainer

    sync_cfg, rollout_cfg = cfg.sync, cfg.rollout
    tp = sync_cfg.rollout_num_gpus_per_engine
    if tp > 1:
        from miles.models.tensor_parallel import check_divisible

        check_divisible(policy, tp)  # before any actor starts
    placement = create_placement(plan_layout(ranks, devices, sync_cfg.colocate), cfg.model.device)
    layout = placement.layout
    log.debug("placement on Ray (device %s): %s", cfg.model.device, layout)
    manager = RolloutManager(
        cfg.model.model,
        devices // tp,
        rollout_cfg.rollout_max_batch_size,
        max_seq_len,
        rollout_cfg.rollout_seed,
        actor_options=[placement.options(b) for b in layout.rollout_bundles],
        tp_size=tp,
        device=cfg.model.device,
        run_cfg=cfg,
    )
    # training runs in actors even for one rank: each gets its own device from its bundle (a
    # driver on "cuda:0" could share a GPU with an engine, and NCCL refuses two ranks on one GPU)
    trainer = RayTrainer(cfg, policy, ranks, [placement.options(b) for b in layout.train_bundles])
    manager.placement = placement  # freed with the engines (training ranks die with it)
    hosts = 1
    if sync_cfg.use_zero_copy_sync:  # handles open only on the host that made them
        hosts = len({ray.get_runtime_context().get_node_id(), *trainer.node_ids(), *manager.node_ids()})
    sync = weight_sync_for(sync_cfg, trainer, manager, on_ray=True, on_gpu=placement.use_gpu, hosts=hosts)
    manager.update_weights(hf_state_dict(policy).items(), version=0)  # the engines start from the policy
    return with_adapters_served(cfg, Executor(trainer, manager, sync))
