"""Training ranks on Ray: data parallelism over `torch.distributed` (gloo on CPU, NCCL on GPU).

Each `TrainerActor` trains on its shard of every global batch. With `--data-parallel ddp` it
holds a full copy of the policy and gradients are averaged with one flattened all-reduce per
optimizer step (what DDP does, but it also covers MoE experts that got no tokens on a rank);
with `fsdp` the policy is sharded by FSDP2. Either way M ranks take the same step as one
process on the whole batch.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError

from miles.config.schema import RunConfig
from miles.data.sample import Sample
from miles.errors import MilesError
from miles.runtime.placement import rendezvous
from miles.sync.group import GroupSender
from miles.sync.object_store import from_object_store, put_buckets
from miles.train.micro_batches import rank_shares


def all_reduce_gradients(model: torch.nn.Module, finite: bool) -> bool:
    """Average gradients over the ranks in place; True only if every rank's loss was finite."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flag = torch.tensor([0.0 if finite else 1.0], device=grads[0].device)
    # on the first gradient's device: offloaded experts' gradients live in host memory
    flat = torch.cat([g.reshape(-1).to(flag.device) for g in grads] + [flag])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).to(p.device, copy=True)
        offset += g.numel()
    return bool(flat[-1] == 0)


def all_reduce_finite(finite: bool, device: torch.device) -> bool:
    """True only if every rank's loss was finite (FSDP2 has already averaged the gradients)."""
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag)
    return bool(flag[0] == 0)


def all_max(count: int, device: torch.device) -> int:
    """The largest `count` over the ranks."""
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value[0])


def all_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` summed over the ranks (global token counts and losses)."""
    values = values.to(device)
    dist.all_reduce(values)
    return values.cpu()


def shard_fsdp(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 `fully_shard` over all ranks: each layer's attention and MLP/MoE are units (they are
    the modules the forward calls), the rest (embeddings, norms, lm_head) the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer.self_attn, mesh=mesh)
        fully_shard(layer.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)


@ray.remote(num_cpus=0)
class TrainerActor(GroupSender):
    """One training rank; rank 0 also sends the weights to the engines (--sync-transport broadcast)."""

    def __init__(
        self, rank: int, world: int, port: int, cfg: RunConfig, threads: int = 1, addr: str = "127.0.0.1"
    ) -> None:
        """`cfg`: the driver's resolved configuration, used as it is (not validated again)."""
        from miles.devices import resolve_device, reuse_freed_memory
        from miles.models import registry
        from miles.train.policy_trainer import PolicyTrainer, needs_reference

        reuse_freed_memory()
        torch.set_num_threads(threads)
        device = resolve_device(cfg.model.device)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        torch.manual_seed(cfg.train.seed)
        policy = registry.model_for(cfg.model.model, seed=cfg.train.seed, device=device)
        self.critic = None
        if cfg.algo.advantage_estimator == "ppo":  # a critic replica on every rank, data-parallel
            from miles.train.critic import Critic, value_model

            self.critic = Critic(
                value_model(policy, cfg.algo.critic_model, cfg.train.seed).to(device), cfg, world
            )
            self.critic.grad_sync = lambda finite: all_reduce_gradients(self.critic.model, finite)
        from miles.train.prepare import prepare_train_model

        prepare_train_model(policy, cfg)  # unified FP8: FP8 forward GEMMs over fp32 master weights
        self.rank, self.fsdp, self.device = rank, cfg.train.data_parallel == "fsdp", device
        self.ep = None  # --expert-model-parallel-size: this rank's share of the experts
        self._delta = None  # --delta-sync on rank 0: the last version sent (DeltaEncoder)
        if cfg.train.expert_model_parallel_size > 1:
            from miles.train import expert_parallel

            self.ep = expert_parallel.setup(policy, rank, world, cfg.train.expert_model_parallel_size)
        self._handles: bytes | None = None  # --use-zero-copy-sync: see share_handles
        if self.fsdp:
            ref = copy.deepcopy(policy) if needs_reference(cfg) else None  # whole, before sharding
            shard_fsdp(policy, device)
            self.actor = PolicyTrainer(policy, cfg, ref_model=ref, world=world)
            self.actor.grad_sync = lambda finite: all_reduce_finite(finite, device)  # FSDP2 reduced the grads
        elif self.ep is not None:
            from miles.train import expert_parallel

            self.actor = PolicyTrainer(policy, cfg, world=world)
            self.actor.grad_sync = lambda finite: expert_parallel.all_reduce_gradients(
                policy, self.ep, finite
            )
            self.actor.clip_grads = lambda max_norm: expert_parallel.clip_grad_norm(policy, self.ep, max_norm)
        else:
            self.actor = PolicyTrainer(policy, cfg, world=world)
            self.actor.grad_sync = lambda finite: all_reduce_gradients(policy, finite)
        self.actor.all_sum = lambda values: all_sum(values, device)
        if self.fsdp or self.ep is not None:  # collectives in every forward: ranks run as many micro-batches
            self.actor.all_max = lambda count: all_max(count, device)

    def train(self, samples: Sequence[Sample], advantages: Sequence[torch.Tensor]) -> dict[str, float]:
        return self.actor.train(samples, advantages)

    def _model_state(self) -> dict[str, torch.Tensor]:
        """Whole weights (FSDP, expert parallelism: gathered, a collective every rank must join;
        only rank 0 gets them, the others an empty dict)."""
        if self.ep is not None:
            from miles.train.expert_parallel import gather_state

            return gather_state(self.actor.model, self.ep) or {}
        if not self.fsdp:
            return self.actor.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def state_dict(self, as_numpy: bool = False) -> dict:
        """The model's weights; `as_numpy` for the driver, which then reads them in place from
        Ray's object store instead of unpickling a copy (~3x faster end to end)."""
        state = self._model_state()
        if as_numpy:
            return {
                k: v.detach().cpu().numpy()
                if v.dtype != torch.bfloat16
                else v.detach().cpu()  # Ray copies it out
                for k, v in state.items()
            }
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def publish(self, bucket_bytes: int) -> list:
        """This rank's weights as buckets in Ray's object store: the engines fetch them from
        here, not through the driver (with FSDP only rank 0 holds whole weights to put)."""
        from miles.sync.payload import published_weights

        return put_buckets(published_weights(self.actor.model, self._model_state()).items(), bucket_bytes)

    def _encode_delta(self, version: int):
        """--delta-sync: (what changed since the last version this rank sent, full bytes); the
        first, and the first after `reset_delta`, is a full version. None on ranks other than 0."""
        from miles.sync.delta import DeltaEncoder
        from miles.sync.payload import published_weights

        state = published_weights(self.actor.model, self._model_state())
        if self.rank != 0:
            return None
        if self._delta is None:
            self._delta = DeltaEncoder()
        delta = self._delta.encode(state.items(), version)
        return delta, sum(t.numel() * t.element_size() for t in state.values())

    def publish_delta(self, version: int):
        """The delta put in the object store: (ref, bytes moved, changed fraction, full bytes)."""
        encoded = self._encode_delta(version)
        if encoded is None:
            return None
        delta, full = encoded
        return ray.put(delta), delta.moved_bytes, delta.changed_fraction, full

    def broadcast_delta(self, version: int):
        """The delta sent over the weight-update group: (bytes moved, changed fraction, full bytes)."""
        import pickle

        encoded = self._encode_delta(version)
        if encoded is None:
            return None
        delta, full = encoded
        self.weight_group.send_blob(pickle.dumps(delta))
        return delta.moved_bytes, delta.changed_fraction, full

    def reset_delta(self) -> None:
        """The next `publish_delta` sends a full version (an engine refused a delta)."""
        if self._delta is not None:
            self._delta.reset()

    def broadcast_weights(self, bucket_bytes: int):
        """Rank 0 broadcasts its weights to the engines (with FSDP every rank joins the gather)."""
        from miles.sync.payload import published_weights

        state = self._model_state()
        if self.rank == 0:
            return self.weight_group.send(published_weights(self.actor.model, state).items(), bucket_bytes)
        return None

    def share_handles(self) -> bytes:
        """Zero-copy: this rank's weights moved into shared memory once (the optimizer keeps
        updating them there) and handles to them, which engines on this host map."""
        if self._handles is None:
            from miles.sync.payload import published_weights
            from miles.sync.transports import handles, share

            named = list(published_weights(self.actor.model).items())
            share(named)
            self._handles = handles(named)
        return self._handles

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def peak_memory(self) -> dict[str, int]:
        from miles.devices import step_peak_memory, training_memory

        return step_peak_memory(self.device) | training_memory(self.actor.model, self.actor.optimizer)

    def offload(self) -> int:
        return self.actor.offload()

    def set_precision(self, mode: str) -> None:
        self.actor.set_precision(mode)

    def critic_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.critic.values(samples)

    def critic_step(self, samples, returns, values, total: int) -> dict[str, float]:
        return self.critic.step(samples, returns, values, total)

    def critic_state(self) -> dict:
        """The critic's weights and optimizer state, on CPU (the driver may have no GPU)."""

        def cpu(x):
            if isinstance(x, torch.Tensor):
                return x.cpu()
            if isinstance(x, dict):
                return {k: cpu(v) for k, v in x.items()}
            if isinstance(x, list):
                return [cpu(v) for v in x]
            return x

        return cpu(self.critic.state_dict())

    def load_critic_state(self, state: dict) -> None:
        self.critic.load_state_dict(state)

    def onload(self) -> int:
        return self.actor.onload()

    def actor_state(self) -> dict:
        state = self.actor.state_dict()
        if self.ep is not None:  # each expert-parallel rank's optimizer state (a collective)
            from miles.train.expert_parallel import gather_optimizer

            state["optimizer"] = gather_optimizer(self.actor.optimizer, self.ep)
        if self.fsdp:  # the whole optimizer state, by parameter name (a collective)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            state["optimizer"] = get_optimizer_state_dict(
                self.actor.model,
                self.actor.optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True),
            )
        return state

    def load(self, model_state: dict[str, torch.Tensor], actor_state: dict) -> None:
        if self.ep is not None:
            from miles.train.expert_parallel import own_slice

            self.actor.model.load_state_dict(own_slice(model_state, self.actor.model))
            self.actor.load_state_dict({**actor_state, "optimizer": actor_state["optimizer"][self.ep.rank]})
            return
        if not self.fsdp:
            self.actor.model.load_state_dict(model_state)
            self.actor.load_state_dict(actor_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.actor.model, model_state, options=whole)
        set_optimizer_state_dict(
            self.actor.model, self.actor.optimizer, optim_state_dict=actor_state["optimizer"], options=whole
        )
        self.actor.scheduler.load_state_dict(actor_state["scheduler"])
        self.actor.skipped_steps = actor_state["skipped_steps"]
        self.actor.consecutive_skipped = actor_state.get("consecutive_skipped", 0)

    def reference_kl(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        return self.actor.reference_kl(samples)

    def reset_reference(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        self.actor.reset_reference(weights)

    def shutdown(self) -> None:
        dist.destroy_process_group()


def split_evenly(items: list, world: int) -> list[list]:
    """Contiguous equal shards (the data order of one process, cut in `world` pieces)."""
    n = len(items) // world
    return [items[r * n : (r + 1) * n] for r in range(world)]


class RayTrainer:
    """`world` TrainerActors behind the interface of the local `PolicyTrainer` (train, state_dict,
    load_state_dict); after each step rank 0's weights are copied into `policy`, the driver's
    copy used for weight sync and checkpoints."""

    def __init__(
        self, cfg, policy: torch.nn.Module, world: int, actor_options: list[dict] | None = None
    ) -> None:
        """`actor_options[r]`: Ray options of rank r (its placement-group bundle and share)."""
        options = actor_options or [{}] * world
        if cfg.lora.enabled:  # the driver's copy carries the same adapters (checkpoints, sync)
            from miles.train.prepare import add_lora

            add_lora(policy, cfg)
        self._rank0_options = options[0]
        addr, port = rendezvous(options[0])  # on rank 0's node
        self.ranks = [
            TrainerActor.options(**options[r]).remote(r, world, port, cfg, addr=addr) for r in range(world)
        ]
        self.policy, self.world, self.cfg = policy, world, cfg
        self._policy_stale = False
        # whole-state reads need every rank (FSDP shards, expert parallelism splits the experts)
        self._collective = cfg.train.data_parallel == "fsdp" or cfg.train.expert_model_parallel_size > 1
        self._submit_lock = threading.Lock()

    def _submit(self, make_calls):
        """Submit one call per rank as a batch no other thread's batch interleaves with (with
        --async-weight-sync a rollout thread may need rank 0's weights while the main thread
        trains): every rank then runs its collectives in the same order."""
        with self._submit_lock:
            return make_calls()

    def reference_kl(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per-token log pi_old - log pi_ref of every sample, each rank computing its shard."""
        if len(samples) % self.world:
            raise ValueError(f"{len(samples)} samples do not split over {self.world} training ranks")
        shards = split_evenly(list(samples), self.world)
        parts = ray.get(self._submit(lambda: [r.reference_kl.remote(s) for r, s in zip(self.ranks, shards)]))
        return [t for part in parts for t in part]

    def train(self, samples: Sequence[Sample], advantages: Sequence[torch.Tensor]) -> dict[str, float]:
        if len(samples) % self.world:
            raise ValueError(f"{len(samples)} samples do not split over {self.world} training ranks")
        train = self.cfg.train
        lengths = [len(s.tokens) for s in samples]
        shares = rank_shares(lengths, self.world, train.global_batch_size, train.use_dynamic_batch_size)
        shards = [([samples[i] for i in share], [advantages[i] for i in share]) for share in shares]
        calls = self._submit(lambda: [r.train.remote(s, a) for r, (s, a) in zip(self.ranks, shards)])
        try:
            per_rank = ray.get(calls)
        except RayActorError as e:  # a rank died: its gradients are lost, the step cannot finish
            raise MilesError(
                f"a training rank died during the step ({type(e).__name__}); the run stops here. Resume from the "
                "last checkpoint with --load (checkpoints need --save and --save-interval)"
            ) from e
        self._policy_stale = True  # the driver's copy is refreshed only when it is needed
        keys = set.intersection(*(set(m) for m in per_rank))
        return {k: sum(m[k] for m in per_rank) / self.world for k in keys}

    def offload(self) -> int:
        """Every rank moves its training state off its GPU (colocated rollout); total bytes."""
        return sum(ray.get(self._submit(lambda: [r.offload.remote() for r in self.ranks])))

    def onload(self) -> int:
        return sum(ray.get(self._submit(lambda: [r.onload.remote() for r in self.ranks])))

    def sync_policy(self) -> None:
        """Bring the driver's copy of the policy up to rank 0's weights (for checkpoints, zero-copy
        sync and --check-weight-update-equal; the standard sync goes rank 0 -> engines directly)."""
        if self._policy_stale:
            state = self._from_rank0(lambda r: r.state_dict.remote(as_numpy=True))
            self.policy.load_state_dict({k: from_object_store(v) for k, v in state.items()})
            self._policy_stale = False

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights by Hugging Face name (through the driver's copy; LoRA: the adapters)."""
        from miles.sync.payload import published_weights

        self.sync_policy()
        return published_weights(self.policy)

    def share_weights(self) -> None:
        """Zero-copy sync: the driver's copy goes to shared memory (used with FSDP, whose ranks
        hold shards only); rank 0 shares its own weights on the first `weight_handles`."""
        from miles.sync.payload import published_weights
        from miles.sync.transports import share

        share(published_weights(self.policy).items())

    def weight_handles(self) -> bytes | None:
        """Handles to rank 0's weights in shared memory (None with FSDP: a rank holds only a shard)."""
        return None if self._collective else ray.get(self.ranks[0].share_handles.remote())

    def node_ids(self) -> list[str]:
        """Rank 0's Ray node (the one that sends weights)."""
        return [ray.get(self.ranks[0].node_id.remote())]

    def peak_memory(self) -> list[dict[str, int]]:
        """Each rank's peak memory since the last call."""
        return ray.get(self._submit(lambda: [r.peak_memory.remote() for r in self.ranks]))

    def set_precision(self, mode: str) -> None:
        ray.get(self._submit(lambda: [r.set_precision.remote(mode) for r in self.ranks]))

    def reset_reference(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Every rank's KL reference becomes its policy now, or `weights` (HF-named)."""
        ray.get(self._submit(lambda: [r.reset_reference.remote(weights) for r in self.ranks]))

    def weight_group_address(self) -> tuple[str, int]:
        return rendezvous(self._rank0_options)

    def join_weight_group(self, addr: str, port: int, world: int) -> None:
        ray.get(self.ranks[0].join_weight_group.remote(addr, port, world))

    def leave_weight_group(self) -> None:
        ray.get(self.ranks[0].leave_weight_group.remote())

    def broadcast_weights(self, bucket_bytes: int):
        """Rank 0 -> every engine over the weight-update group; its `SyncStats`."""
        return self._from_rank0(lambda r: r.broadcast_weights.remote(bucket_bytes))

    def publish(self, bucket_bytes: int) -> list:
        """Rank 0's weights as object-store buckets, for `RolloutManager.update_weights_from_buckets`."""
        return self._from_rank0(lambda r: r.publish.remote(bucket_bytes))

    def publish_delta(self, version: int):
        """Rank 0's delta on the last version (`miles.sync.delta`): (ref, moved, changed, full bytes)."""
        return self._from_rank0(lambda r: r.publish_delta.remote(version))

    def broadcast_delta(self, version: int):
        """Rank 0's delta over the weight-update group: (moved, changed, full bytes)."""
        return self._from_rank0(lambda r: r.broadcast_delta.remote(version))

    def reset_delta(self) -> None:
        self._from_rank0(lambda r: r.reset_delta.remote())

    def _from_rank0(self, call):
        """Rank 0's answer to `call(rank)`; with FSDP every rank joins (the whole state is gathered)."""
        ranks = self.ranks if self._collective else self.ranks[:1]
        return ray.get(self._submit(lambda: [call(r) for r in ranks]))[0]

    def state_dict(self) -> dict:
        return self._from_rank0(lambda r: r.actor_state.remote())

    def load_state_dict(self, state: dict) -> None:
        model_state = self.policy.state_dict()
        ray.get(self._submit(lambda: [r.load.remote(model_state, state) for r in self.ranks]))


class RayCritic:
    """The PPO critic on the training ranks: each rank's process holds a replica on its device and
    trains it data-parallel on its shard of the batch (gradients averaged over the ranks, the loss
    a token-mean over the global batch), so the critic is placed as the training ranks are,
    colocated with engines or not. The same interface as the local `Critic`."""

    def __init__(self, trainer: RayTrainer, cfg) -> None:
        self.trainer, self.cfg = trainer, cfg

    def _shards(self, *lists):
        world = self.trainer.world
        if len(lists[0]) % world:
            raise ValueError(f"{len(lists[0])} samples do not split over {world} training ranks")
        return zip(self.trainer.ranks, *(split_evenly(list(x), world) for x in lists))

    def values(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        shards = list(self._shards(samples))
        parts = ray.get(self.trainer._submit(lambda: [r.critic_values.remote(s) for r, s in shards]))
        return [v for part in parts for v in part]

    def advantages(self, samples: Sequence[Sample], kl=None):
        from miles.train.critic import gae_advantages

        values = self.values(samples)
        return (*gae_advantages(samples, values, self.cfg, kl), values)

    def train(self, samples, returns, values) -> dict[str, float]:
        from miles.train.critic import value_stats

        total = sum(len(r) for r in returns)
        shards = list(self._shards(samples, returns, values))
        parts = ray.get(
            self.trainer._submit(lambda: [r.critic_step.remote(s, t, v, total) for r, s, t, v in shards])
        )
        metrics = {k: sum(p[k] for p in parts) for k in ("value_loss", "value_clipfrac")}  # each rank's part
        metrics.update(critic_grad_norm=parts[0]["critic_grad_norm"], critic_lr=parts[0]["critic_lr"])
        return {**metrics, **value_stats(values, returns)}

    def state_dict(self) -> dict:
        return ray.get(self.trainer.ranks[0].critic_state.remote())

    def load_state_dict(self, state: dict) -> None:
        ray.get([r.load_critic_state.remote(state) for r in self.trainer.ranks])
