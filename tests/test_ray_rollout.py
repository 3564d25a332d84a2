"""Rollout on Ray: several engine actors give the local engine's samples; a killed actor is
restarted, re-synced and its requests redone, so the step's samples are complete."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import ray
import torch
from hypothesis import given
from hypothesis import strategies as st

from miles.models import save_model
from miles.rollout import Engine, Request, SamplingParams
from miles.runtime.ray_rollout import RolloutManager
from tests.conftest import random_model


def requests_for(n: int, new_tokens: int, vary: int = 0) -> list[Request]:
    """`n` requests of `new_tokens` tokens each, plus `vary` x (i mod 8) for request i."""
    return [
        Request(
            [1 + i % 7, 2, 3],
            SamplingParams(
                temperature=1.0, max_new_tokens=new_tokens + vary * (i % 8), seed=1000 + i, ignore_eos=True
            ),
        )
        for i in range(n)
    ]


def generate_killing(manager: RolloutManager, reqs: list[Request], victim: int, after_s: float):
    """The manager's samples for `reqs`, with actor `victim` killed `after_s` seconds in."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(samples=manager.generate(reqs)))
    worker.start()
    time.sleep(after_s)  # mid-rollout
    ray.kill(manager.actors[victim], no_restart=False)
    worker.join(timeout=240)
    return result["samples"]


def assert_engines_hold(manager: RolloutManager, state: dict[str, torch.Tensor]) -> None:
    for engine_state in manager.states():
        assert all(torch.equal(engine_state[k], v) for k, v in state.items())


def test_actors_match_local_engine_and_take_weight_updates(ray_cluster, tmp_path):
    base = random_model("qwen3_moe", seed=1)
    save_model(base, tmp_path / "base")
    manager = RolloutManager(str(tmp_path / "base"), num_engines=2, max_batch_size=8, max_seq_len=64)
    local = Engine(random_model("qwen3_moe", seed=1), max_batch_size=8, max_seq_len=64)
    got = manager.generate(requests_for(10, 6))
    want = local.generate(requests_for(10, 6))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    # the engines' times, summed: as many decode tokens as the one local engine decoded
    assert manager.take_times().decode_tokens == local.take_times().decode_tokens > 0
    new = random_model("qwen3_moe", seed=2)
    manager.update_weights(new.state_dict().items(), version=5, bucket_bytes=40_000)
    local.update_weights(new.state_dict().items(), version=5)
    got = manager.generate(requests_for(6, 6))
    assert [s.tokens for s in got] == [s.tokens for s in local.generate(requests_for(6, 6))]
    assert all(s.weight_versions == [5] for s in got)
    for actor in manager.actors:
        version, state = ray.get(actor.state.remote())
        assert version == 5 and all(torch.equal(state[k], v) for k, v in new.state_dict().items())


def test_killed_engine_is_restarted_and_the_step_completes(ray_cluster, tmp_path):
    base = random_model("llama", seed=3)
    save_model(base, tmp_path / "base")
    manager = RolloutManager(str(tmp_path / "base"), num_engines=2, max_batch_size=4, max_seq_len=512)
    new = random_model("llama", seed=4)
    manager.update_weights(new.state_dict().items(), version=2)
    victim_pid = ray.get(manager.actors[1].pid.remote())
    samples = generate_killing(manager, requests_for(40, 400), victim=1, after_s=0.5)
    assert manager.restarts == 1 and ray.get(manager.actors[1].pid.remote()) != victim_pid
    assert len(samples) == 40 and all(s.response_length == 400 for s in samples)
    assert all(s.weight_versions == [2] for s in samples)  # the restarted actor got the new weights
    local = Engine(new, max_batch_size=4, max_seq_len=512)
    assert [s.tokens for s in samples] == [s.tokens for s in local.generate(requests_for(40, 400))]

    # killed between syncs: the next sync restarts it instead of stopping the run
    ray.kill(manager.actors[0], no_restart=False)
    newer = random_model("llama", seed=5)
    manager.update_weights(newer.state_dict().items(), version=3)
    assert_engines_hold(manager, newer.state_dict())


def test_a_draft_update_restarts_an_engine_that_died_and_gives_it_the_draft(ray_cluster, tmp_path):
    """Online draft training: an engine killed after its rollout, before the draft's new weights
    go out, is restarted by that update (not a stopped run) and holds the new draft, as after
    every later weight sync."""
    from miles.config import load_config
    from miles.rollout.drafts import auto_draft
    from tests.conftest import small_run_args

    cfg = load_config(small_run_args(tmp_path, 1) + ["--draft-model", "auto", "--online-sft-interval", "1"])
    save_model(random_model("llama", seed=3), tmp_path / "base")
    manager = RolloutManager(
        str(tmp_path / "base"), num_engines=2, max_batch_size=4, max_seq_len=64, run_cfg=cfg
    )
    draft = auto_draft(random_model("llama", seed=8), cfg.speculative.draft_layers).state_dict()
    victim_pid = ray.get(manager.actors[1].pid.remote())
    ray.kill(manager.actors[1], no_restart=False)
    manager.update_draft(draft)
    assert manager.restarts == 1 and ray.get(manager.actors[1].pid.remote()) != victim_pid
    for actor in manager.actors:
        held = ray.get(actor.draft_state.remote())
        assert held.keys() == draft.keys() and all(torch.equal(held[k], v) for k, v in draft.items())
    ray.kill(manager.actors[0], no_restart=False)  # and a weight sync gives a restarted engine the draft
    manager.update_weights(random_model("llama", seed=4).state_dict().items(), version=2)
    held = ray.get(manager.actors[0].draft_state.remote())
    assert manager.restarts == 2 and all(torch.equal(held[k], v) for k, v in draft.items())


def test_broadcast_sync_survives_an_engine_restart(ray_cluster, tmp_path):
    """Weights broadcast over the weight-update group; an engine killed mid-rollout comes back
    with the current weights (from the object store), and the next broadcast re-forms the group
    with the new process: every engine ends equal to the trainer."""
    from tests.conftest import DriverWeightSource

    save_model(random_model("llama", seed=3), tmp_path / "base")
    manager = RolloutManager(str(tmp_path / "base"), num_engines=2, max_batch_size=4, max_seq_len=512)
    trainer = random_model("llama", seed=4)
    source = DriverWeightSource(trainer)
    stats = manager.update_weights_by_broadcast(source, version=2, bucket_bytes=50_000)
    assert stats.buckets > 1
    samples = generate_killing(manager, requests_for(40, 400), victim=1, after_s=0.5)
    assert manager.restarts == 1 and len(samples) == 40
    assert all(s.weight_versions == [2] for s in samples)
    local = Engine(random_model("llama", seed=4), max_batch_size=4, max_seq_len=512)
    assert [s.tokens for s in samples] == [s.tokens for s in local.generate(requests_for(40, 400))]

    trainer.load_state_dict(random_model("llama", seed=5).state_dict())
    manager.update_weights_by_broadcast(source, version=3, bucket_bytes=50_000)
    assert_engines_hold(manager, trainer.state_dict())

    # an engine that died since the last sync: the broadcast fails, the manager waits for the
    # restart and syncs every engine through the object store; the sync after re-forms the group
    victim_pid = ray.get(manager.actors[0].pid.remote())
    ray.kill(manager.actors[0], no_restart=False)
    trainer.load_state_dict(random_model("llama", seed=6).state_dict())
    stats = manager.update_weights_by_broadcast(source, version=4, bucket_bytes=50_000)
    assert ray.get(manager.actors[0].pid.remote()) != victim_pid and stats.payload_bytes > 0
    assert all(v == 4 for v, _ in ray.get([a.state.remote() for a in manager.actors]))
    assert_engines_hold(manager, trainer.state_dict())
    trainer.load_state_dict(random_model("llama", seed=7).state_dict())
    stats = manager.update_weights_by_broadcast(source, version=5, bucket_bytes=50_000)
    assert stats.moved_bytes == 2 * stats.payload_bytes  # over the group again, to both engines
    assert_engines_hold(manager, trainer.state_dict())


def test_killed_rank_of_a_tensor_parallel_engine_restarts_the_engine(ray_cluster, tmp_path):
    """One rank of a 2-way tensor-parallel engine killed mid-rollout (rank 1, then in the next
    rollout rank 0): the manager stops the other rank too, starts both again at a fresh
    rendezvous, gives them the current weights and redoes the requests; the samples are the
    whole model's."""
    save_model(random_model("qwen3_moe", seed=3), tmp_path / "base")
    manager = RolloutManager(
        str(tmp_path / "base"), num_engines=1, max_batch_size=4, max_seq_len=512, tp_size=2
    )
    new = random_model("qwen3_moe", seed=4)
    manager.update_weights(new.state_dict().items(), version=2)
    want = Engine(new, max_batch_size=4, max_seq_len=512).generate(requests_for(8, 120))
    for restarts, victim in enumerate((1, 0), start=1):
        old_pids = ray.get([a.pid.remote() for a in manager.actors])
        samples = generate_killing(manager, requests_for(8, 120), victim=victim, after_s=0.5)
        assert manager.restarts == restarts
        assert not set(ray.get([a.pid.remote() for a in manager.actors])) & set(old_pids)  # both ranks new
        assert len(samples) == 8 and all(s.weight_versions == [2] for s in samples)
        assert [s.tokens for s in samples] == [s.tokens for s in want]
    manager.shutdown()


def test_weights_land_mid_rollout_between_decoding_steps(ray_cluster, tmp_path):
    """An update sent while an engine actor is generating (--async-weight-sync) does not wait for
    the rollout: it lands between two decoding steps, so running requests list both versions,
    and the engine ends with exactly the new weights."""
    save_model(random_model("llama", seed=3), tmp_path / "base")
    manager = RolloutManager(str(tmp_path / "base"), num_engines=1, max_batch_size=4, max_seq_len=512)
    manager.update_weights(random_model("llama", seed=4).state_dict().items(), version=1)
    result = {}
    # lengths differ, so the 4 slots never turn over at one step: whenever the update lands, a
    # running request spans it
    reqs = requests_for(40, 300, vary=17)
    worker = threading.Thread(target=lambda: result.update(samples=manager.generate(reqs)))
    worker.start()
    time.sleep(0.5)  # mid-rollout
    new = random_model("llama", seed=5)
    manager.update_weights(new.state_dict().items(), version=2, bucket_bytes=20_000)  # several buckets
    assert worker.is_alive()  # returned before the rollout ended
    worker.join(timeout=240)
    versions = [s.weight_versions for s in result["samples"]]
    assert [1, 2] in versions and all(v in ([1], [1, 2], [2]) for v in versions)
    assert_engines_hold(manager, new.state_dict())


def test_corrupted_object_store_bucket_is_named(ray_cluster, tmp_path):
    """A bucket whose bytes changed after its checksums were taken: every engine refuses it,
    naming the tensor, and the error is not mistaken for a dead engine (no restart)."""
    from miles.sync import SyncIntegrityError, pack_bucket, plan_buckets

    save_model(random_model("llama", seed=3), tmp_path / "base")
    manager = RolloutManager(str(tmp_path / "base"), num_engines=2, max_batch_size=4, max_seq_len=64)
    buckets = []
    for items in plan_buckets(random_model("llama", seed=4).state_dict().items(), 50_000):
        flat, meta = pack_bucket(items)
        if any(name == "model.norm.weight" for name, _ in items):
            offset = next(m.offset for m in meta.tensors if m.name == "model.norm.weight")
            flat[offset] ^= 0x01
        buckets.append((meta, ray.put(flat.numpy())))
    with pytest.raises(SyncIntegrityError, match="model.norm.weight"):
        manager.update_weights_from_buckets(buckets, version=1)
    assert manager.restarts == 0


@given(
    groups=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=0, max_size=30),
    n=st.integers(1, 5),
)
def test_split_by_prompt_keeps_groups_on_one_engine(groups, n):
    """Every request goes to exactly one engine, all requests with one prompt to the same one
    (it prefills the prompt once), and the engines' loads differ by at most one group's size."""
    from miles.runtime.ray_rollout import split_by_prompt

    reqs = [Request([p, 7], SamplingParams()) for p, size in groups for _ in range(size)]
    chunks = split_by_prompt(reqs, n)
    assert len(chunks) == n and sorted(i for c in chunks for i in c) == list(range(len(reqs)))
    engine_of = {}
    for e, chunk in enumerate(chunks):
        for i in chunk:
            assert engine_of.setdefault(tuple(reqs[i].prompt_ids), e) == e
    sizes = {}
    for r in reqs:
        sizes[tuple(r.prompt_ids)] = sizes.get(tuple(r.prompt_ids), 0) + 1
    loads = [len(c) for c in chunks]
    assert max(loads) - min(loads) <= max(sizes.values(), default=0)


def test_tool_conversations_on_ray_engines_equal_the_local_engines(ray_cluster, tmp_path):
    """Built-in tool calling through the Ray engines: the same conversations, token for token,
    as through one local engine (the turns batch across engines like any rollout)."""
    from miles.agents.tool_rollout import ToolCalling
    from miles.agents.tools import ToolBox, load_tools
    from miles.models.tokenizer import byte_tokenizer
    from tests.agent_fixtures import always_calculator

    tok = byte_tokenizer()
    save_model(random_model("qwen3_moe", seed=3, vocab_size=len(tok)), tmp_path / "m", tokenizer=tok)
    manager = RolloutManager(str(tmp_path / "m"), num_engines=2, max_batch_size=8, max_seq_len=512)
    local = Engine(
        random_model("qwen3_moe", seed=3, vocab_size=len(tok)), tok, max_batch_size=8, max_seq_len=512
    )
    box = ToolBox(load_tools(["calculator"]))
    calling = ToolCalling(box, always_calculator, ["</tool_call>"], max_turns=2, max_turn_tokens=5)

    def conversations(rollout):
        prompts = [calling.prompt_ids(tok, f"q{i}", True) for i in range(6)]
        return calling.generate(
            rollout, [Request(p, SamplingParams(max_new_tokens=60, seed=i)) for i, p in enumerate(prompts)]
        )

    try:
        # no stop string: the engines never load the tokenizer; the manager decodes the text
        plain = [Request([1, 2, 3], SamplingParams(max_new_tokens=20, seed=i)) for i in range(4)]
        texts = [s.response for s in manager.generate(plain)]
        assert texts == [s.response for s in local.generate(copy.deepcopy(plain))] and all(texts)
        got, want = conversations(manager), conversations(local)
    finally:
        box.close()
        manager.shutdown()
    assert [(s.tokens, s.loss_mask) for s in got] == [(s.tokens, s.loss_mask) for s in want]
    assert [s.response for s in got] == [s.response for s in want]
    assert all(s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1 for s in got)
    assert all(s.rollout_routed_experts.shape[0] == len(s.tokens) - 1 for s in got)
