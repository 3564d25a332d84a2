"""Weight sync, chosen once per run: how the trainer's weights reach the rollout engines.

One class per way, each with `push(version) -> SyncStats`:

- `InProcessBuckets`: trainer and engine share this process; checksummed buckets through one
  staging buffer, landing between two decoding steps.
- `SharedMemory`: zero-copy. The trainer's weights live in shared memory (CUDA IPC on GPUs);
  engines on this host map them from handles of a few hundred bytes.
- `ObjectStore`: training rank 0 puts checksummed buckets into Ray's object store once; every
  engine actor fetches them (and a restarted actor fetches them again).
- `Broadcast`: rank 0 broadcasts buckets over a weight-update group (gloo on CPU, NCCL on GPU).

`choose_transport` is the rule that picks one (and says why when it falls back);
`CheckedSync` wraps any of them with --check-weight-update-equal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from miles.errors import ConfigError, MilesError
from miles.sync.buckets import checksum
from miles.sync.delta import deliver
from miles.sync.payload import published_weights
from miles.sync.transports import (
    BucketBuffer,
    SyncStats,
    handles,
    send_bucketed,
    send_shared,
    shared_memory_available,
)

log = logging.getLogger("miles")


class WeightSync(Protocol):
    name: str

    def push(self, version: int) -> SyncStats: ...


def choose_transport(
    requested: str, zero_copy: bool, on_ray: bool, on_gpu: bool, colocate: bool, hosts: int, shm: bool
) -> str:
    """One of in-process, shared-memory, object-store, broadcast, from --sync-transport and
    --use-zero-copy-sync and the layout; every fallback from what was asked is logged once."""
    if zero_copy and not shm:
        log.warning("--use-zero-copy-sync: shared memory is not available here; using the standard sync")
    elif zero_copy and hosts > 1:
        log.warning(
            "--use-zero-copy-sync: the trainer and the rollout engines are on %d hosts, and memory handles only "
            "open on the host that made them; using the standard sync",
            hosts,
        )
    elif zero_copy:
        return "shared-memory"
    if not on_ray:
        if requested == "broadcast":
            log.warning(
                "--sync-transport broadcast: the engine runs in this process; weights are copied directly"
            )
        return "in-process"
    if on_gpu and colocate:  # NCCL refuses two ranks on one GPU
        if requested == "broadcast":
            log.warning(
                "--sync-transport broadcast with --colocate on GPUs: NCCL cannot join a rank and an engine "
                "on the same GPU; using the object store (--use-zero-copy-sync maps the weights instead)"
            )
        return "object-store"
    if requested == "broadcast" or (requested == "auto" and on_gpu):
        return "broadcast"
    return "object-store"


@dataclass
class InProcessBuckets:
    """A trainer and an `Engine` in this process."""

    trainer: object  # PolicyTrainer
    engine: object  # Engine
    bucket_bytes: int
    name: str = "in-process buckets"

    def __post_init__(self) -> None:
        self.staging = BucketBuffer()  # one staging buffer for the whole run

    def push(self, version: int) -> SyncStats:
        with self.engine.paused():  # every bucket lands before the next decoding step (async rollouts)
            return send_bucketed(
                self.trainer.hf_weights().items(),
                self.engine,
                version,
                self.bucket_bytes,
                staging=self.staging,
            )


@dataclass
class ServerSync:
    """--rollout-backend sglang: the trainer's weights to every server by the rollout's transport
    (a checkpoint on disk, or SGLang's weight-update group; `SGLangRollout.update_weights`)."""

    trainer: object
    rollout: object  # SGLangRollout
    name: str = "SGLang servers"

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        named = list(self.trainer.hf_weights().items())
        self.rollout.update_weights(named, version=version)
        payload = sum(t.numel() * t.element_size() for _, t in named)
        return SyncStats(
            len(named), 1, payload, payload * len(self.rollout.servers), time.perf_counter() - t0
        )


class SharedMemory:
    """Zero-copy: the engines map the trainer's own memory. The trainer shares its weights once
    (the optimizer then updates them in place, where the engines read them)."""

    name = "zero-copy (shared memory handles)"

    def __init__(self, trainer, rollout, engine_in_process: bool) -> None:
        self.trainer, self.rollout, self.in_process = trainer, rollout, engine_in_process
        self.trainer.share_weights()

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        blob = self.trainer.weight_handles()  # rank 0's own; None: the weights this process holds
        if blob is None:
            named = list(self.trainer.hf_weights().items())
            if self.in_process:
                return send_shared(named, self.rollout, version)
            blob = handles(named)  # the driver's copy (FSDP ranks hold shards only)
        self.rollout.update_weights_from_handles(blob, version)
        payload = sum(t.numel() * t.element_size() for t in published_weights(self.trainer.policy).values())
        return SyncStats(0, 1, payload, len(blob), time.perf_counter() - t0)


@dataclass
class _RankZeroToEngines:
    """A sync from training rank 0 to the Ray engine actors."""

    trainer: object  # RayTrainer
    rollout: object  # RolloutManager
    bucket_bytes: int


class ObjectStore(_RankZeroToEngines):
    """Training rank 0 puts buckets into Ray's object store; every engine actor fetches them."""

    name = "Ray object store buckets"

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        buckets = self.trainer.publish(self.bucket_bytes)
        self.rollout.update_weights_from_buckets(buckets, version)
        payload = sum(meta.nbytes for meta, _ in buckets)
        tensors = sum(len(meta.tensors) for meta, _ in buckets)
        return SyncStats(tensors, len(buckets), payload, payload, time.perf_counter() - t0)


class DeltaObjectStore(_RankZeroToEngines):
    """--delta-sync: rank 0 puts only what changed since the engines' version (`miles.sync.delta`);
    engines that refuse it (a restarted one, a checksum that fails) get a full version."""

    name = "Ray object store, deltas"

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        first: list = []  # the first send's (changed fraction, full bytes)

        def send(only: list[int] | None) -> tuple[list[int], int]:
            ref, moved, changed, payload = self.trainer.publish_delta(version)
            first.append((changed, payload))
            refused = self.rollout.update_weights_from_delta(
                self.trainer, ref, version, self.bucket_bytes, only
            )
            return refused, moved if only is None else moved * len(only)  # one put; then one per refuser

        moved = deliver(version, send, self.trainer.reset_delta)
        changed, payload = first[0]
        return SyncStats(0, 1, payload, moved, time.perf_counter() - t0, changed)


class DeltaBroadcast(_RankZeroToEngines):
    """--delta-sync over the weight-update group: rank 0 broadcasts what changed; a refusal
    (a restarted engine, a checksum that fails) is followed by a full version to every engine."""

    name = "broadcast over the weight-update group, deltas"

    def push(self, version: int) -> SyncStats:
        return self.rollout.update_weights_by_broadcast(self.trainer, version, self.bucket_bytes, delta=True)


class Broadcast(_RankZeroToEngines):
    """Rank 0 broadcasts to every engine over the weight-update group."""

    name = "broadcast over the weight-update group"

    def push(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        stats = self.rollout.update_weights_by_broadcast(self.trainer, version, self.bucket_bytes)
        stats.seconds = time.perf_counter() - t0
        return stats


@dataclass
class CheckedSync:
    """--check-weight-update-equal: after each push, every engine's weights must equal the
    trainer's, checksum by checksum."""

    inner: WeightSync
    trainer: object
    rollout: object

    @property
    def name(self) -> str:
        return f"{self.inner.name}, checked"

    def push(self, version: int) -> SyncStats:
        stats = self.inner.push(version)
        want = {name: checksum(t) for name, t in self.trainer.hf_weights().items()}
        differ = sorted(
            {n for state in self.rollout.states() for n, c in want.items() if checksum(state[n]) != c}
        )
        if differ:
            raise MilesError(
                f"--check-weight-update-equal: engine weights differ from the trainer's after sync: {differ[:5]}"
            )
        return stats


def make_weight_sync(
    transport: str,
    trainer,
    rollout,
    bucket_bytes: int,
    check_equal: bool,
    on_ray: bool = False,
    delta: bool = False,
) -> WeightSync:
    """The strategy object for a transport chosen by `choose_transport`."""
    sync: WeightSync
    if delta:
        if transport not in ("object-store", "broadcast"):
            raise ConfigError(
                f"--delta-sync sends deltas to Ray engines through the object store or the weight-update "
                f"group, but this run syncs by {transport}; use it with Ray engines (--rollout-num-gpus 2 or more), "
                "without --use-zero-copy-sync"
            )
        sync = (DeltaBroadcast if transport == "broadcast" else DeltaObjectStore)(
            trainer, rollout, bucket_bytes
        )
    elif transport == "in-process":
        sync = InProcessBuckets(trainer, rollout, bucket_bytes)
    elif transport == "shared-memory":
        sync = SharedMemory(trainer, rollout, engine_in_process=not on_ray)
    elif transport == "broadcast":
        sync = Broadcast(trainer, rollout, bucket_bytes)
    else:
        sync = ObjectStore(trainer, rollout, bucket_bytes)
    return CheckedSync(sync, trainer, rollout) if check_equal else sync


def weight_sync_for(
    sync_cfg, trainer, rollout, on_ray: bool = False, on_gpu: bool = False, hosts: int = 1
) -> WeightSync:
    """The run's weight sync from its --sync-* settings and layout (`choose_transport`'s rule)."""
    transport = choose_transport(
        sync_cfg.sync_transport, sync_cfg.use_zero_copy_sync, on_ray, on_gpu, sync_cfg.colocate, hosts,
        shared_memory_available(),
    )  # fmt: skip
    return make_weight_sync(
        transport, trainer, rollout, sync_cfg.sync_bucket_size, sync_cfg.check_weight_update_equal, on_ray,
        sync_cfg.delta_sync,
    )  # fmt: skip
