"""Rollout on Ray: N engine actors behind one manager, with weight sync and fault recovery.

Requests are split across the actors; each actor runs its own continuous-batching `Engine`.
New weights travel as checksummed buckets, either put once into Ray's object store and fetched
by every actor, or broadcast by the trainer over a weight-update group (`miles.sync.group`;
`--sync-transport broadcast`). An actor that dies mid-rollout is restarted by Ray (it reloads
the base checkpoint), gets the latest weights again, and redoes its unfinished requests: the
step's samples stay complete. Per-request seeds make the redone samples the same as if nothing
had happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from miles.data.sample import Sample, Status
from miles.errors import MilesError
from miles.rollout.sampling import Request
from miles.sync.buckets import BucketMeta, SyncIntegrityError, unpack_bucket
from miles.sync.delta import deliver
from miles.sync.object_store import from_object_store, put_buckets
from miles.sync.transports import SyncStats

log = logging.getLogger("miles.ray")
# partial rollout on several engines: decoding steps each engine runs between two checks of the
# driver (more: fewer round trips; fewer: a cut closer to the moment enough groups are done)
LOCKSTEP_STEPS = 4


def split_by_prompt(requests: Sequence[Request], n: int) -> list[list[int]]:
    """Request indices for each of `n` engines: requests with the same prompt (a GRPO group) go
    to one engine, which prefills the prompt once for all of them; each group goes to the engine
    with the fewest requests so far (largest groups first), so the loads differ by at most one
    group's size."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        by_prompt.setdefault(tuple(r.prompt_ids), []).append(i)
    chunks: list[list[int]] = [[] for _ in range(n)]
    for group in sorted(by_prompt.values(), key=len, reverse=True):
        min(chunks, key=len).extend(group)
    return [sorted(c) for c in chunks]


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)
class EngineActor:
    """One rollout engine in its own process."""

    def __init__(
        self,
        model: str,
        max_batch_size: int,
        max_seq_len: int,
        seed: int,
        threads: int = 1,
        tp: tuple[int, int, str, int] | None = None,
        device: str = "cpu",
        run_cfg=None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """`tp` = (rank, size, addr, port): this actor is one rank of a tensor-parallel engine.
        `device`: --device (cuda: the GPU Ray gave this actor). The engine works in token ids (the
        manager holds the tokenizer and writes each sample's text); `eos_token_ids`: the
        tokenizer's end of text. The tokenizer is loaded here only for requests with stop strings."""
        from miles.devices import resolve_device, reuse_freed_memory, yield_to_trainer
        from miles.models import registry
        from miles.rollout.engine import Engine

        reuse_freed_memory()
        torch.set_num_threads(threads)
        dev = self.device = resolve_device(device)
        if dev.type == "cpu" and run_cfg is not None and run_cfg.sync.rollout_mode == "fully-async":
            yield_to_trainer(whole_process=True)
        self.tp_rank, self.tp_size = (tp[0], tp[1]) if tp else (0, 1)
        if tp:
            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if dev.type == "cuda" else "gloo",
                init_method=f"tcp://{tp[2]}:{tp[3]}",
                rank=self.tp_rank,
                world_size=self.tp_size,
            )
        # a tensor-parallel rank reads only its own part of the checkpoint
        self.model_spec = model
        policy = registry.model_for(model, tp=(self.tp_rank, self.tp_size) if tp else None)
        policy.to(dev)
        speculator, options = None, {}
        if run_cfg is not None:  # the run's configuration, as the driver resolved it (FP8, INT4, draft)
            from miles.quant.convert import prepare_rollout_model
            from miles.rollout.drafts import speculator_for

            speculator = speculator_for(run_cfg.speculative, policy, max_batch_size, max_seq_len)
            policy = prepare_rollout_model(policy, run_cfg)
            options = run_cfg.rollout.engine_options()
        self.engine = Engine(
            policy,
            None,
            max_batch_size,
            max_seq_len=max_seq_len,
            seed=seed,
            speculator=speculator,
            eos_token_ids=eos_token_ids,
            **options,
        )
        self._mapped, self._mapped_blob = None, None  # zero-copy: the trainer's memory, mapped once
        self._decoder = None  # --delta-sync: the last version received, to apply the next delta on

    def _mine(self, named):
        """The full HF tensors of a sync, cut to this rank's part for a tensor-parallel engine."""
        if self.tp_size == 1:
            return named
        from miles.models.tensor_parallel import shard_named

        return shard_named(named, self.tp_rank, self.tp_size)

    def _tokenizer_for(self, requests: list[Request]) -> None:
        """Stop strings are matched on text: the engine gets the tokenizer the first time one comes."""
        if self.engine.tokenizer is None and any(r.params.stop for r in requests):
            from miles.models.registry import tokenizer_for

            self.engine.tokenizer = tokenizer_for(self.model_spec)

    def generate(self, requests: list[Request]) -> list[Sample]:
        self._tokenizer_for(requests)
        return self.engine.generate(requests)

    def start(self, requests: list[Request]) -> None:
        """Partial rollout: take `requests`; `advance` runs them in lock-step with the other engines."""
        self._tokenizer_for(requests)
        for r in requests:
            self.engine.add_request(r)

    def advance(self, steps: int) -> tuple[list[Sample], bool]:
        """Up to `steps` engine steps: the samples they finished, and whether every request has
        ended. The driver stops all engines between two such calls, so where a rollout is cut
        depends on step counts, never on timing."""
        finished: list[Sample] = []
        for _ in range(steps):
            if not self.engine.has_work():
                break
            finished += self.engine.step()
        return finished, not self.engine.has_work()

    def stop(self) -> list[Sample]:
        """Abort what still runs (tokens so far kept) and return it."""
        self.engine.abort_all()
        return self.engine.step() if self.engine.has_work() else []

    def apply_delta(self, delta) -> bool:
        """--delta-sync: the next version from a delta on the one this engine holds; False (the
        weights untouched) when it does not apply here, and the sender then sends a full one."""
        from miles.sync.delta import DeltaDecoder, DeltaRefused

        self._decoder = self._decoder or DeltaDecoder()
        try:
            named = self._decoder.apply(delta)
        except DeltaRefused as e:
            log.warning("engine refused delta v%d: %s", delta.version, e)
            return False
        self.engine.update_weights(self._mine(named), version=delta.version)
        return True

    def update_weights(self, buckets: list[tuple[BucketMeta, ray.ObjectRef]], version: int) -> int:
        self._decoder = None  # weights that did not come as a delta: the chain starts again
        with self.engine.paused():  # all buckets land between the same two decoding steps
            for meta, ref in buckets:
                flat = ref if isinstance(ref, torch.Tensor) else from_object_store(ray.get(ref))
                self.engine.update_weights(self._mine(unpack_bucket(flat, meta)), version=version)
        return self.engine.weight_version

    def update_weights_from_handles(self, blob: bytes, version: int) -> int:
        """Map the trainer's shared weights once and keep the mapping: the trainer updates them
        in place, so later syncs with the same handles only copy. (Dropping a mapping lets the
        shm manager unlink the file, and the next open fails.)"""
        from miles.sync.transports import open_handles

        if blob != self._mapped_blob:
            self._mapped, self._mapped_blob = open_handles(blob), blob
        self.engine.update_weights(self._mine(self._mapped), version=version)
        return self.engine.weight_version

    def join_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Become rank `rank` of a new weight-update group (any previous one is left)."""
        from miles.sync.group import WeightGroup

        self._weight_group = None
        self._weight_group = WeightGroup(addr, port, rank, world, self.device)

    def receive_delta(self) -> bool:
        """--delta-sync over the weight-update group: one delta (`apply_delta`)."""
        import pickle

        return self.apply_delta(pickle.loads(self._weight_group.receive_blob()))

    def receive_weights(self, version: int) -> int:
        """Take one broadcast sync from the weight-update group, bucket by bucket."""
        self._decoder = None  # weights that did not come as a delta: the chain starts again
        with self.engine.paused():
            for named in self._weight_group.receive():
                self.engine.update_weights(self._mine(named), version=version)
        return self.engine.weight_version

    def release_memory(self) -> int:
        return self.engine.release_memory()

    def kv_cache_bytes(self) -> int:
        return self.engine.kv_cache_bytes

    def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        from miles.rollout.weights import served_weights

        return self.engine.weight_version, {k: v.cpu() for k, v in served_weights(self.engine.model).items()}

    def pid(self) -> int:
        import os

        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def peak_memory(self) -> dict[str, int]:
        from miles.devices import step_peak_memory, weight_memory

        return step_peak_memory(self.device) | weight_memory(self.engine.model)

    def set_precision(self, mode: str) -> None:
        self.engine.set_precision(mode)

    def update_draft(self, state: dict[str, torch.Tensor]) -> None:
        self.engine.update_draft(state)

    def draft_state(self) -> dict[str, torch.Tensor]:
        """The speculative draft's weights (what update_draft last set)."""
        return {k: v.cpu() for k, v in self.engine.draft.model.state_dict().items()}

    def take_spec_stats(self):
        return self.engine.take_spec_stats()

    def take_times(self):
        return self.engine.take_times()


class RolloutManager:
    """Spreads requests over `num_engines` engines; recovers from an actor's death. An engine is
    one actor, or `tp_size` actors holding a tensor-parallel split of the model."""

    def __init__(
        self,
        model: str,
        num_engines: int,
        max_batch_size: int = 64,
        max_seq_len: int = 512,
        seed: int = 0,
        max_retries: int = 3,
        actor_options: list[dict] | None = None,
        tp_size: int = 1,
        device: str = "cpu",
        run_cfg=None,
    ) -> None:
        """`run_cfg`: the run's configuration, for every engine (FP8). `actor_options[i]`: Ray options of actor i (its placement-group bundle and share);
        engine j is actors j*tp_size .. (j+1)*tp_size - 1."""

        from miles.models.registry import tokenizer_for

        # prompts are encoded and responses decoded here; the engines work in token ids
        self.tokenizer = tokenizer_for(model)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self._options = actor_options or [{}] * (num_engines * tp_size)
        self._engine_args = (model, max_batch_size, max_seq_len, seed)
        self._eos = () if eos is None else (eos,)
        self.tp_size, self.device, self.run_cfg = tp_size, device, run_cfg
        self.engines: list[list] = [self._start_engine(j) for j in range(num_engines)]
        self.actors = [a for g in self.engines for a in g]
        self.max_retries = max_retries
        self._buckets: list[tuple[BucketMeta, ray.ObjectRef]] = []
        self._handles: bytes | None = None
        self._source = None  # the trainer side of the weight-update group (--sync-transport broadcast)
        self._group_formed = False
        self._draft: ray.ObjectRef | None = None  # the speculative draft's latest weights (online training)
        self._bucket_bytes = 512 * 1024**2
        self.placement = None  # set by the executor that reserved the bundles; freed by shutdown()
        self.version = 0
        self.restarts = 0

    def _start_engine(self, j: int) -> list:
        """Engine j's actors (j*tp_size .. (j+1)*tp_size - 1 of the options); a tensor-parallel
        engine's ranks meet at a fresh rendezvous on its first rank's node."""
        from miles.runtime.placement import rendezvous

        members = self._options[j * self.tp_size : (j + 1) * self.tp_size]
        if self.tp_size == 1:  # two threads: a weight update lands mid-rollout, between decoding steps
            return [
                EngineActor.options(**members[0], max_concurrency=2).remote(
                    *self._engine_args, device=self.device, run_cfg=self.run_cfg, eos_token_ids=self._eos
                )
            ]
        addr, port = rendezvous(members[0])
        # one thread: the ranks must swap weights at the same step (an update waits for the rollout);
        # a restarted rank could not rejoin its process group: the manager restarts them all
        return [
            EngineActor.options(**opts, max_restarts=0).remote(
                *self._engine_args,
                tp=(r, self.tp_size, addr, port),
                device=self.device,
                run_cfg=self.run_cfg,
                eos_token_ids=self._eos,
            )
            for r, opts in enumerate(members)
        ]

    def update_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = 512 * 1024**2
    ) -> int:
        """Put each bucket into the object store once; every actor fetches it. The buckets are
        kept (until the next update) to re-sync an actor that restarts. Returns their count."""
        return self.update_weights_from_buckets(put_buckets(named, bucket_bytes), version)

    def update_weights_from_buckets(
        self, buckets: list[tuple[BucketMeta, ray.ObjectRef]], version: int
    ) -> int:
        """Every actor fetches buckets already in the object store (a training rank put them there);
        they are kept to re-sync an actor that restarts. Returns their count."""
        self._buckets, self._handles, self._source, self.version = buckets, None, None, version
        self._sync_every_engine()
        return len(buckets)

    def update_weights_from_delta(
        self, source, delta_ref, version: int, bucket_bytes: int, only: list[int] | None = None
    ) -> list[int]:
        """--delta-sync: every engine (or those of `only`) applies the delta rank 0 put in the
        object store; the engines that refused it. One that died meanwhile is restarted and given
        full buckets from `source` (the trainer), so it refuses the next delta and rejoins the chain."""
        self._buckets, self._handles, self._source, self.version = [], None, source, version
        self._bucket_bytes = bucket_bytes
        picked = range(len(self.engines)) if only is None else only
        results = self._on_every_engine(
            lambda group: [a.apply_delta.remote(delta_ref) for a in group], [self.engines[j] for j in picked]
        )
        return [j for j, ok in zip(picked, results) if ok is not None and not all(ok)]

    def update_weights_from_handles(self, blob: bytes, version: int) -> None:
        """Zero-copy: every actor maps the trainer's shared memory from the handles in `blob`."""
        self._buckets, self._handles, self._source, self.version = [], blob, None, version
        self._sync_every_engine()

    def update_weights_by_broadcast(
        self, source, version: int, bucket_bytes: int, delta: bool = False
    ) -> SyncStats:
        """The trainer (`source`, a `RayTrainer`) broadcasts its weights to every engine
        process over the weight-update group; the group is formed on first use, and again after
        an engine restarted (its old peer is gone). `delta` (--delta-sync): only what changed
        (`miles.sync.delta`); if an engine refuses it, a full version follows to every engine."""
        self._source, self._bucket_bytes = source, bucket_bytes
        self._buckets, self._handles, self.version = [], None, version
        try:
            if delta:
                return self._broadcast_delta(source, version)
            return self._broadcast(source, version, bucket_bytes)
        except (RayActorError, RayTaskError, RuntimeError) as e:
            cause = e.cause if isinstance(e, RayTaskError) else e
            if isinstance(e, SyncIntegrityError) or isinstance(cause, SyncIntegrityError):
                raise  # corrupted weights stop the run
            log.warning(
                "weight broadcast failed (%s); restarting engines that died and syncing every engine "
                "through the object store instead",
                str(e).splitlines()[0][:200],
            )
            t0 = time.perf_counter()
            source.leave_weight_group()  # engines still waiting on the group get an error, not a hang
            if delta:
                source.reset_delta()  # the engines get full buckets: the next delta starts a new chain
            self._group_formed = False
            self._buckets = source.publish(bucket_bytes)
            self._sync_every_engine()
            payload = sum(meta.nbytes for meta, _ in self._buckets)
            tensors = sum(len(meta.tensors) for meta, _ in self._buckets)
            return SyncStats(tensors, len(self._buckets), payload, payload, time.perf_counter() - t0)

    def _sync_every_engine(self) -> None:
        """Every engine takes the latest weights (as `_resync` sends them); one that died since
        the last call is restarted and synced again, so a sync never stops the run for it."""
        self._on_every_engine(self._resync)

    def _on_every_engine(self, call, groups: list | None = None) -> list:
        """`call(group)`'s remote calls on every engine (or on `groups`), and their results; an
        engine that died before or during them is restarted and given the latest weights and
        draft (`_recover`), and its result is None."""
        groups = self.engines if groups is None else groups
        refs = [call(group) for group in groups]
        results = []
        for group, engine_refs in zip(groups, refs):
            try:
                results.append(ray.get(engine_refs))
            except (RayActorError, RayTaskError) as e:
                if not self._engine_died(e):
                    raise  # a bug or corrupted weights, not a dead process
                j = self.engines.index(group)
                log.warning("rollout engine %d died before a weight or draft update; restarting it", j)
                self._recover(j)
                results.append(None)
        return results

    def _engine_died(self, e: Exception) -> bool:
        """An actor's process is gone, or (tensor-parallel) a rank failed because its peer died."""
        return isinstance(e, RayActorError) or (self.tp_size > 1 and isinstance(e.cause, RuntimeError))

    def _broadcast_delta(self, source, version: int) -> SyncStats:
        """A delta over the group; a full version follows to every member (the group has no
        other way) if any refused it (`miles.sync.delta.deliver`)."""
        t0 = time.perf_counter()
        first: list = []  # the first send's (changed fraction, full bytes)

        def send(only: list[int] | None) -> tuple[list[int], int]:
            self._form_group(source)
            receives = [a.receive_delta.remote() for a in self.actors]
            sent, changed, full = source.broadcast_delta(version)
            first.append((changed, full))
            return [j for j, ok in enumerate(ray.get(receives)) if not ok], sent * len(self.actors)

        moved = deliver(version, send, source.reset_delta)
        changed, full = first[0]
        return SyncStats(0, 1, full, moved, time.perf_counter() - t0, changed)

    def _form_group(self, source) -> None:
        if not self._group_formed:
            addr, port = source.weight_group_address()
            world = len(self.actors) + 1
            joins = [a.join_weight_group.remote(addr, port, i + 1, world) for i, a in enumerate(self.actors)]
            source.join_weight_group(addr, port, world)
            ray.get(joins)
            self._group_formed = True

    def _broadcast(self, source, version: int, bucket_bytes: int) -> SyncStats:
        self._form_group(source)
        # a tensor-parallel engine's ranks run one call at a time: with --async-weight-sync a rollout
        # may still run there, so send once every engine can receive (nobody waits out a rollout)
        idle = [a.pid.remote() for a in self.actors]
        receives = [a.receive_weights.remote(version) for a in self.actors]
        ray.get(idle)
        stats = source.broadcast_weights(bucket_bytes)
        ray.get(receives)
        return stats

    def peak_memory(self) -> list[dict[str, int]]:
        """Each engine process's peak memory since the last call."""
        return ray.get([a.peak_memory.remote() for a in self.actors])

    def set_precision(self, mode: str) -> None:
        ray.get([a.set_precision.remote(mode) for a in self.actors])

    def update_draft(self, state: dict[str, torch.Tensor]) -> None:
        """The draft's new weights to every engine (one object-store copy, read by all)."""
        self._draft = ray.put(state)  # kept: a restarted engine gets it back in _resync
        self._on_every_engine(lambda group: [a.update_draft.remote(self._draft) for a in group])

    def take_spec_stats(self):
        from miles.rollout.speculative import SpecStats

        return SpecStats.merge(ray.get([a.take_spec_stats.remote() for a in self.actors]))

    def take_times(self):
        from miles.rollout.engine import EngineTimes

        return EngineTimes.merge(ray.get([a.take_times.remote() for a in self.actors]))

    def node_ids(self) -> list[str]:
        """The Ray node of each engine actor."""
        return ray.get([a.node_id.remote() for a in self.actors])

    @property
    def weight_version(self) -> int:
        return self.version

    def release_memory(self) -> int:
        """Every engine frees its KV cache (colocated training is about to run); total bytes."""
        return sum(ray.get([a.release_memory.remote() for a in self.actors]))

    def shutdown(self) -> None:
        """Stop the engine actors (and, when it owns one, the placement group with everything in it)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Every engine's weights, whole (for --check-weight-update-equal)."""
        from miles.models.tensor_parallel import unshard

        out = []
        for group in self.engines:
            parts = [state for _, state in ray.get([a.state.remote() for a in group])]
            out.append({name: unshard(name, [p[name] for p in parts]) for name in parts[0]})
        return out

    def _recover(self, index: int) -> None:
        """Engine `index` lost an actor: wait for Ray to restart it (a one-process engine), or
        start all its ranks again (a tensor-parallel engine); then give it the current weights."""
        self.restarts += 1
        self._group_formed = False  # its place in the weight-update group died with it
        if self.tp_size > 1:
            for a in self.engines[index]:
                ray.kill(a, no_restart=True)
            self.engines[index] = self._start_engine(index)
            self.actors = [a for g in self.engines for a in g]
        deadline = time.time() + 120
        while True:
            try:
                ray.get(self._resync(self.engines[index]))
                return
            except RayActorError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    def _resync(self, actors: list) -> list[ray.ObjectRef]:
        """The latest weights to `actors`, by the way the last sync went (a ping before any sync),
        and the draft's latest weights when it is trained online."""
        # an actor runs one caller's calls in order: the draft arrives before the weights, and a
        # dead actor shows in the refs (never here), where the caller restarts it
        draft = [a.update_draft.remote(self._draft) for a in actors] if self._draft is not None else []
        if self._handles is not None:
            return draft + [a.update_weights_from_handles.remote(self._handles, self.version) for a in actors]
        if self._source is not None and not self._buckets:  # broadcast sync: via the object store,
            self._buckets = self._source.publish(self._bucket_bytes)  # put once for every retry and engine
        if not self._buckets:
            return draft + [a.pid.remote() for a in actors]
        return draft + [a.update_weights.remote(self._buckets, self.version) for a in actors]

    def generate_until(self, requests: Sequence[Request], enough) -> tuple[list[Sample], list[Sample]]:
        """Partial rollout over the engines: run `requests` until `enough(finished so far)` holds,
        the engines in lock-step (`LOCKSTEP_STEPS` decoding steps each between two checks), then
        abort the rest: (finished, aborted with their tokens so far). The cut is the same in
        every run, however busy the machine.
        An engine that dies here stops the run (resume from the last checkpoint); whole rollouts
        (`generate`) restart it instead."""
        chunks = split_by_prompt(requests, len(self.engines))
        work = [(g[0], [requests[j] for j in c]) for g, c in zip(self.engines, chunks) if c]
        finished: list[Sample] = []
        try:
            ray.get([actor.start.remote(chunk) for actor, chunk in work])
            while True:  # every engine advances the same number of steps, results read in engine order
                results = ray.get([actor.advance.remote(LOCKSTEP_STEPS) for actor, _ in work])
                finished += self._with_text([s for new, _ in results for s in new])
                if all(done for _, done in results):
                    return finished, []
                if enough(finished):
                    parts = ray.get([actor.stop.remote() for actor, _ in work])
                    rest = self._with_text([s for part in parts for s in part])
                    finished += [s for s in rest if s.status != Status.ABORTED]
                    return finished, [s for s in rest if s.status == Status.ABORTED]
        except (RayActorError, RayTaskError) as e:
            raise MilesError(
                f"a rollout engine died during a partial rollout ({type(e).__name__}); the run stops here. Resume "
                "from the last checkpoint with --load"
            ) from e

    def generate(self, requests: Sequence[Request]) -> list[Sample]:
        """All samples, in request order, whatever happens to the actors on the way."""
        n = len(self.engines)
        chunks = split_by_prompt(requests, n)

        def submit(i: int) -> list:  # every rank of a tensor-parallel engine runs the same requests
            return [a.generate.remote([requests[j] for j in chunks[i]]) for a in self.engines[i]]

        pending = {i: submit(i) for i, chunk in enumerate(chunks) if chunk}
        out: list[Sample | None] = [None] * len(requests)
        attempts = dict.fromkeys(pending, 0)
        while pending:
            i, refs = next(iter(pending.items()))
            try:
                samples = ray.get(refs)[0]
            except (RayActorError, RayTaskError) as e:
                if not self._engine_died(e):
                    raise
                attempts[i] += 1
                if attempts[i] > self.max_retries:
                    raise
                log.warning(
                    "rollout engine %d died; restarting it and redoing its %d requests", i, len(chunks[i])
                )
                self._recover(i)
                pending[i] = submit(i)
                continue
            for j, s in zip(chunks[i], self._with_text(samples)):
                out[j] = s
            del pending[i]
        return out  # type: ignore[return-value]

    def _with_text(self, samples: list[Sample]) -> list[Sample]:
        """Each sample's response text, decoded from its tokens as an in-process engine does."""
        if self.tokenizer is not None:
            for s in samples:
                s.response = self.tokenizer.decode(s.response_tokens, skip_special_tokens=True)
        return samples
