"""A tensor-parallel engine (2 gloo ranks) generates what the whole model generates."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.errors import MilesError
from miles.models import save_model
from miles.models.checkpoint import load_model
from miles.models.tensor_parallel import check_divisible, shard_model, shard_named, split_dim, unshard
from miles.rollout import Engine, Request, SamplingParams
from tests.conftest import ARCHS, free_port, random_model


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        prompt = torch.randint(3, 97, (3 + 2 * i,), generator=gen).tolist()
        temperature = 0.0 if i % 2 else 0.9
        out.append(
            Request(
                prompt, SamplingParams(temperature=temperature, max_new_tokens=12, seed=i, ignore_eos=True)
            )
        )
    return out


def generate(model) -> list[tuple[list[int], list[float], object]]:
    engine = Engine(model, max_batch_size=4, max_seq_len=64, seed=0)  # 4 slots: slot reuse too
    return [(s.tokens, s.rollout_log_probs, s.rollout_routed_experts) for s in engine.generate(requests())]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for arch in ARCHS:  # each rank reads its own part of the saved checkpoint
        model = load_model(os.path.join(out_dir, arch), tp=(rank, world))
        results[arch] = generate(model)
        results[arch + "/kv_heads"] = model.config.num_key_value_heads
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_two_rank_engine_matches_the_whole_model(tmp_path):
    for arch in ARCHS:
        save_model(random_model(arch, seed=5), tmp_path / arch)
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for arch in ARCHS:
        whole = generate(random_model(arch, seed=5))
        assert ranks[0][arch + "/kv_heads"] == random_model(arch).config.num_key_value_heads // 2
        a, b = ranks[0][arch], ranks[1][arch]
        moe = random_model(arch).config.is_moe
        for (ta, la, ra), (tb, lb, rb), (tw, lw, rw) in zip(a, b, whole):
            assert ta == tb and la == lb  # the ranks agree exactly: same all-reduced hidden states
            assert ta == tw, arch  # and generate what the whole model does
            assert max(abs(x - y) for x, y in zip(la, lw)) < 1e-5, arch
            # routing: recorded by every side of a MoE model (never silently missing), and the same
            assert (
                all(r is not None for r in (ra, rb, rw)) == moe
                and all(r is None for r in (ra, rb, rw)) != moe
            )
            if moe:
                assert ra.shape == rw.shape and ra.size > 0, arch
                assert (ra == rb).all() and (ra == rw).all(), arch


def test_shard_then_unshard_is_the_identity():
    model = random_model("qwen2_moe")
    full = list(model.state_dict().items())
    parts = [shard_named(full, r, 2) for r in range(2)]
    for i, (name, t) in enumerate(full):
        pieces = [p[i][1] for p in parts]
        assert torch.equal(unshard(name, pieces), t), name
        if ".q_proj." in name or ".down_proj.weight" in name:
            assert pieces[0].numel() == t.numel() // 2  # really split


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe", "llama_tied"])
def test_loading_a_rank_reads_only_its_part(tmp_path, arch, monkeypatch):
    """load_model(tp=(rank, 2)) gives what sharding the whole model gives, and never reads a split
    tensor whole from the checkpoint."""
    import safetensors

    model = (
        random_model("llama", seed=3, tie_word_embeddings=True)
        if arch == "llama_tied"
        else random_model(arch)
    )
    save_model(model, tmp_path / "ckpt")
    whole_reads = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.f.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    monkeypatch.setattr("miles.models.checkpoint.safe_open", Spy)
    for rank in range(2):
        got = load_model(tmp_path / "ckpt", tp=(rank, 2))
        want = shard_model(copy.deepcopy(model), rank, 2)
        assert got.state_dict().keys() == want.state_dict().keys()
        for name, t in want.state_dict().items():
            assert torch.equal(got.state_dict()[name], t), (rank, name)
        assert torch.equal(got.inv_freq, want.inv_freq)
        assert got.config.num_attention_heads == model.config.num_attention_heads // 2
    assert whole_reads and not [n for n in whole_reads if split_dim(n) is not None]


def test_sizes_that_do_not_split_are_refused():
    model = random_model("llama")  # 4 heads, 2 kv heads
    with pytest.raises(MilesError, match="--rollout-num-gpus-per-engine 4.*num_key_value_heads"):
        check_divisible(model, 4)
