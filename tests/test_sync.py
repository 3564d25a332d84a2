"""Weight sync: buckets are bit-exact and corruption is caught; every transport leaves the engine
equal to the trainer; zero-copy really shares memory across processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.rollout import Engine
from miles.sync import SyncIntegrityError, pack_bucket, plan_buckets, unpack_bucket
from miles.sync.group import WeightGroup
from miles.sync.transports import (
    handles,
    open_handles,
    send_bucketed,
    send_one_at_a_time,
    send_shared,
    share,
)
from tests.conftest import free_port, random_model


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 33, generator=g)),
        ("b.bf16", torch.randn(17, generator=g).to(torch.bfloat16)),
        ("c.ids", torch.randint(0, 1000, (5, 7), generator=g)),
        ("d.scalar", torch.tensor(3.5)),
        ("e.strided", torch.randn(8, 8, generator=g).t()),
    ]


def test_buckets_round_trip_bit_for_bit():
    named = mixed_tensors()
    buckets = plan_buckets(named, bucket_bytes=2000)
    assert len(buckets) > 1 and all(
        sum(t.numel() * t.element_size() for _, t in b) <= 2000 or len(b) == 1 for b in buckets
    )
    got = [item for b in buckets for item in unpack_bucket(*pack_bucket(b))]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(
            have.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)
        )


def test_corrupted_bucket_names_the_tensor():
    flat, meta = pack_bucket(mixed_tensors())
    c = next(m for m in meta.tensors if m.name == "c.ids")
    flat[c.offset + 3] ^= 0xFF
    with pytest.raises(SyncIntegrityError, match=r"1 tensor\(s\) arrived corrupted: \['c.ids'\]"):
        unpack_bucket(flat, meta)


@pytest.mark.parametrize("transport", ["bucketed", "one_at_a_time", "shared_memory"])
def test_every_transport_leaves_engine_equal_to_trainer(transport):
    trainer = random_model("qwen3_moe", seed=1)
    engine = Engine(random_model("qwen3_moe", seed=2), max_batch_size=1, max_seq_len=8)
    named = list(trainer.state_dict().items())
    if transport == "bucketed":
        stats = send_bucketed(named, engine, version=3, bucket_bytes=50_000)
        assert stats.buckets > 1
    elif transport == "one_at_a_time":
        stats = send_one_at_a_time(named, engine, version=3)
    else:
        share(named)
        stats = send_shared(named, engine, version=3)
        assert stats.moved_bytes < stats.payload_bytes / 10  # handles, not bytes
    assert engine.weight_version == 3
    for name, t in trainer.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name


def _reader(blob: bytes, inbox, outbox) -> None:
    named = dict(open_handles(blob))
    outbox.put(float(named["w"][0, 0]))  # first read
    inbox.get()  # wait: the parent writes through its own tensor
    outbox.put(float(named["w"][0, 0]))


def test_zero_copy_shares_memory_across_processes():
    small, large = torch.zeros(16, 16), torch.zeros(2048, 2048)
    share([("w", small), ("big", large)])
    assert len(handles([("w", torch.zeros(2048, 2048).share_memory_())])) < 2 * len(
        handles([("w", torch.zeros(4, 4).share_memory_())])
    )
    ctx = mp.get_context("spawn")
    to_child, from_child = ctx.SimpleQueue(), ctx.SimpleQueue()
    child = ctx.Process(target=_reader, args=(handles([("w", small)]), to_child, from_child))
    child.start()
    assert from_child.get() == 0.0
    small[0, 0] = 42.0  # a write made through the trainer's tensor
    to_child.put("go")
    assert from_child.get() == 42.0  # seen by the other process: same memory
    child.join(timeout=30)


def _group_member(rank: int, world: int, port: int, tp_port: int, corrupt: bool, results) -> None:
    """Rank 0 sends two syncs (seed 5, then seed 6 weights); ranks 1 and 2 are the processes of
    one tensor-parallel engine, with a default group of their own beside the weight group."""
    if rank > 0:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(tp_port))
        dist.init_process_group("gloo", rank=rank - 1, world_size=world - 1)
    group = WeightGroup("127.0.0.1", port, rank, world, torch.device("cpu"))
    if corrupt and rank == 0:
        import miles.sync.group as grp

        original = grp.pack_bucket

        def bad_pack(items, checksums=True):
            flat, meta = original(items, checksums)
            if any(name == "model.embed_tokens.weight" for name, _ in items):
                flat = flat.clone()
                flat[0] ^= 0xFF  # after the checksum was taken: corrupted on the way
            return flat, meta

        grp.pack_bucket = bad_pack
    try:
        for seed in (5,) if corrupt else (5, 6):  # receivers stop after a corrupted sync
            if rank == 0:
                stats = group.send(random_model("llama", seed=seed).state_dict().items(), bucket_bytes=30_000)
                results.put((0, seed, stats.buckets > 1))
                continue
            got = {name: t.clone() for bucket in group.receive() for name, t in bucket}
            want = random_model("llama", seed=seed).state_dict()
            equal = got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
            results.put((rank, seed, equal))
    except SyncIntegrityError as e:
        results.put((rank, "corrupt", str(e)))
    finally:
        if rank > 0:
            dist.barrier()  # the engine's own group still works after the weight group's traffic
            dist.destroy_process_group()


@pytest.mark.parametrize("corrupt", [False, True])
def test_weight_group_broadcasts_to_engine_processes(corrupt):
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _group_member,
        args=(3, free_port(), free_port(), corrupt, results),
        nprocs=3,
        start_method="spawn",
    )
    got = sorted((results.get() for _ in range(6 if not corrupt else 3)), key=str)
    if corrupt:  # the sender finishes; both receivers stop with the corrupted tensor's name
        receivers = [r for r in got if r[0] != 0]
        assert [r[0] for r in receivers] == [1, 2]
        assert all(r[1] == "corrupt" and "model.embed_tokens.weight" in r[2] for r in receivers)
        return
    assert got == sorted(
        [(0, 5, True), (0, 6, True), (1, 5, True), (1, 6, True), (2, 5, True), (2, 6, True)], key=str
    )


def test_check_weight_update_equal_stops_on_a_mismatch():
    from miles.config import make_config
    from miles.errors import MilesError
    from miles.sync.strategy import make_weight_sync
    from miles.train.policy_trainer import PolicyTrainer

    trainer = random_model("llama", seed=1)
    engine = Engine(random_model("llama", seed=2), max_batch_size=1, max_seq_len=8)
    sync = make_weight_sync(
        "in-process", PolicyTrainer(trainer, make_config({})), engine, 10_000, check_equal=True
    )
    assert sync.push(1).buckets > 1
    real = engine.update_weights

    def lossy(items, version=None):  # a transport that drops one tensor
        real([(n, t) for n, t in items if n != "model.norm.weight"], version=version)

    engine.update_weights = lossy
    with torch.no_grad():
        trainer.model.norm.weight.add_(1.0)
    with pytest.raises(MilesError, match=r"differ from the trainer's after sync: \['model.norm.weight'\]"):
        sync.push(2)
