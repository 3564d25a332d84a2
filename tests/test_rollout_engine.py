"""The rollout engine: greedy vs transformers, sampling distribution, logprobs, R3, weight updates."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from miles.data import Status
from miles.models import save_model
from miles.rollout import Engine, Request, SamplingParams
from miles.rollout.engine import EngineTimes
from miles.rollout.sampling import Uniforms, sample_tokens
from tests.conftest import random_model, response_logprobs


def peaked(arch: str, seed: int = 0, **kw):
    """A random model with large weights, so next-token distributions are far from uniform."""
    model = random_model(arch, seed=seed, **kw)
    model.init_weights(std=0.15, seed=seed)
    return model.eval()


def prompts(n: int, vocab: int = 97, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("model_arch", ["qwen3_moe", "llama"])
def test_greedy_equals_transformers_generate(model_arch, tmp_path):
    model = peaked(model_arch, seed=3)
    save_model(model, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ps = prompts(6)
    engine = Engine(model, max_batch_size=4, max_seq_len=64)  # 6 requests, 4 slots: slots are reused
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    samples = engine.generate([Request(p, params) for p in ps])
    for p, s in zip(ps, samples):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        assert s.tokens == ref[0].tolist()
        assert s.status == Status.TRUNCATED and s.response_length == 16


def test_sampler_matches_known_distribution_chi_square():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    probs = torch.softmax(logits / 0.7, -1)
    n = 20_000
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, logprobs = sample_tokens(
        logits.expand(n, -1), torch.full((n,), 0.7), torch.full((n,), -1), torch.ones(n), gens
    )
    counts = torch.bincount(tokens, minlength=8).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor(7 / 2, dtype=torch.double), chi2 / 2)
    assert p_value > 1e-3, (chi2, p_value)
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])  # reported: softmax(logits / T)


@pytest.mark.parametrize("block", [1, 3, 16])
def test_uniforms_read_ahead_are_the_generators_numbers_one_at_a_time(block):
    """The engine reads each request's generator a block at a time; the numbers, in order, are
    those of one draw at a time, so the tokens are what they were without reading ahead."""
    ahead = Uniforms(torch.Generator().manual_seed(7), block)
    one_by_one = torch.Generator().manual_seed(7)
    got = [ahead.next() for _ in range(40)]
    assert got == [float(torch.rand((), generator=one_by_one)) for _ in range(40)]
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    args = (torch.ones(5), torch.full((5,), -1), torch.ones(5))
    streams = [Uniforms(torch.Generator().manual_seed(i), block) for i in range(5)]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    for _ in range(4):
        assert torch.equal(sample_tokens(logits, *args, streams)[0], sample_tokens(logits, *args, gens)[0])


def test_top_k_top_p_never_leave_the_allowed_set():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    n = 5000
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    t, _ = sample_tokens(logits.expand(n, -1), torch.ones(n), torch.full((n,), 2), torch.ones(n), gens)
    assert set(t.tolist()) == {0, 1}
    # top-p .6: probs sorted .45, .27, .17...: the smallest prefix reaching .6 is {0, 1}
    probs = torch.softmax(logits, -1)
    assert probs[0] < 0.6 < probs[0] + probs[1]
    t, _ = sample_tokens(
        logits.expand(n, -1), torch.ones(n), torch.full((n,), -1), torch.full((n,), 0.6), gens
    )
    counts = torch.bincount(t, minlength=6).double()
    assert set(t.tolist()) == {0, 1}
    # within the set, frequencies follow the renormalised distribution
    assert abs(counts[0] / n - probs[0] / (probs[0] + probs[1])) < 0.03


def test_engine_first_token_distribution_and_seed_independence():
    model = peaked("qwen3", seed=1, vocab_size=8)
    prompt = [1, 2, 3]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.9, -1).double()
    engine = Engine(model, max_batch_size=64, max_seq_len=8, seed=5)
    n = 3000
    params = SamplingParams(temperature=0.9, max_new_tokens=1)
    samples = engine.generate([Request(prompt, params) for _ in range(n)])
    counts = torch.bincount(torch.tensor([s.tokens[-1] for s in samples]), minlength=8).double()
    chi2 = ((counts - probs * n) ** 2 / (probs * n)).sum()
    assert torch.special.gammaincc(torch.tensor(3.5, dtype=torch.double), chi2 / 2) > 1e-3
    # a request's tokens depend on its seed alone, not on the batch around it
    p = SamplingParams(temperature=1.0, max_new_tokens=10, seed=42, ignore_eos=True)
    alone = Engine(model, max_batch_size=1, max_seq_len=32).generate([Request(prompt, p)])[0]
    crowd = Engine(model, max_batch_size=8, max_seq_len=32).generate(
        [Request([5, 6], SamplingParams(max_new_tokens=7)) for _ in range(3)] + [Request(prompt, p)]
    )[3]
    assert alone.tokens == crowd.tokens


@pytest.mark.parametrize("model_arch", ["llama", "qwen3_moe"])
def test_engine_logprobs_equal_trainer_recomputation(model_arch):
    """The engine's reported log-probs equal what the trainer computes for its loss, on its own
    path (`PolicyTrainer.logprobs`: micro-batches, shared prompts computed once, routing replay)."""
    from miles.config import make_config
    from miles.train.policy_trainer import PolicyTrainer

    model = peaked(model_arch, seed=2)
    engine = Engine(model, max_batch_size=8, max_seq_len=64, seed=0)
    requests = [
        Request(p, SamplingParams(temperature=0.8, max_new_tokens=20, ignore_eos=True, seed=k))
        for p in prompts(5, seed=4)
        for k in range(3)
    ]  # groups of 3 samples of one prompt
    samples = engine.generate(requests)
    assert len({s.response_length for s in samples}) == 1 and len({len(s.tokens) for s in samples}) > 1
    assert len({tuple(s.tokens) for s in samples}) > 5  # the group's samples differ
    replays = (False, True) if model.config.is_moe else (False,)
    for share_prompts in (True, False):
        for replay in replays:
            cfg = make_config(
                {
                    "rollout_temperature": 0.8,
                    "share_prompts": share_prompts,
                    "use_r3": replay,
                    "micro_batch_size": 4,
                }
            )
            recomputed = PolicyTrainer(model, cfg).logprobs(samples)
            diff = max(
                abs(a - float(b)) for s, r in zip(samples, recomputed) for a, b in zip(s.rollout_log_probs, r)
            )
            assert diff < 1e-5, (share_prompts, replay, diff)
    if model.config.is_moe:
        s = samples[0]
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, 2, 2)


def test_routing_replay_removes_the_mismatch_from_flipped_experts():
    """A trainer whose numerics differ slightly (attention weights x (1 + 1e-2 noise)) picks
    other experts for some tokens; replaying the engine's routing cuts the worst logprob gap."""
    model = peaked("qwen3_moe", seed=6)
    engine = Engine(model, max_batch_size=8, max_seq_len=64)
    # enough responses that some sampled token's experts flip (at 6 the worst gap may come from
    # the attention noise alone, for some seeds)
    samples = engine.generate(
        [Request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts(32)]
    )
    trainer_model = peaked("qwen3_moe", seed=6)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer_model.named_parameters():
            if "self_attn" in name and "proj" in name:
                p.mul_(1 + torch.randn(p.shape, generator=gen) * 1e-2)
        flipped = [
            (
                trainer_model(torch.tensor([s.tokens[:-1]])).routed_experts[0].numpy()
                != s.rollout_routed_experts
            )
            .any(-1)
            .mean()
            for s in samples
        ]
    assert 0.01 < sum(flipped) / len(flipped) < 0.5  # some, not most, tokens route differently

    def worst_gap(replay: bool) -> float:
        got = response_logprobs(trainer_model, samples, replay_routing=replay)
        return max(abs(a - b) for s, r in zip(samples, got) for a, b in zip(s.rollout_log_probs, r))

    assert worst_gap(replay=True) < 0.5 * worst_gap(replay=False)
    # replayed, the trainer reports exactly the engine's experts
    from miles.train.batch import pack_samples

    batch = pack_samples(samples, replay_routing=True)
    with torch.no_grad():
        routed = trainer_model(
            batch.input_ids, batch.attention_mask, forced_experts=batch.forced_experts
        ).routed_experts
    for b, s in enumerate(samples):
        assert (routed[b, : len(s.tokens) - 1].numpy() == s.rollout_routed_experts).all()


def test_continuous_batching_reuses_slots():
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    long = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    reqs = [Request([1, 2, 3], long)] + [Request([4, 5, i], short) for i in range(12)]
    for r in reqs:
        engine.add_request(r)
    steps, done = 0, []
    while engine.has_work():
        done += engine.step()
        steps += 1
    assert len(done) == 13
    # static batches of 4 would take 40 + 3 + 3 + 3 steps; here the 12 short ones share 3 slots
    assert steps <= 41
    # and slot reuse does not disturb anyone: each equals its own run alone
    for s in done:
        alone = Engine(model, max_batch_size=1, max_seq_len=64).generate(
            [Request(s.tokens[: s.prompt_length], long if s.response_length == 40 else short)]
        )[0]
        assert alone.tokens == s.tokens


def test_engine_times_count_each_decode_step_and_token():
    """Every token but a request's first (sampled from its prefill) comes from a decode step,
    and a step decodes every running request: 3 requests of 5, 2 and 7 tokens in 4 slots take
    6 steps and 11 decode tokens."""
    engine = Engine(peaked("llama"), max_batch_size=4, max_seq_len=64)
    lengths = [5, 2, 7]
    engine.generate(
        [Request([3, 4, i], SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    )
    times = engine.take_times()
    assert (times.decode_steps, times.decode_tokens) == (max(lengths) - 1, sum(lengths) - len(lengths))
    assert times.prefill_seconds > 0 and times.decode_seconds > 0
    assert times.decode_tokens_per_second == times.decode_tokens / times.decode_seconds
    assert engine.take_times() == EngineTimes()  # taken: the next call starts from zero
    both = EngineTimes.merge([times, None, times])  # engines that report, summed
    assert (both.decode_steps, both.decode_seconds) == (2 * times.decode_steps, 2 * times.decode_seconds)
    assert EngineTimes.merge([None]) is None


def test_stop_rules_and_statuses():
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    free = engine.generate(
        [Request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))]
    )[0]
    stop_at = free.response_tokens[3]
    first = free.response_tokens.index(stop_at)
    s = engine.generate(
        [Request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop_at]))]
    )[0]
    assert s.status == Status.COMPLETED and s.response_tokens == free.response_tokens[: first + 1]
    assert s.loss_mask == [1] * s.response_length and len(s.rollout_log_probs) == s.response_length
    assert free.status == Status.TRUNCATED


def test_stop_string_with_tokenizer():
    from miles.models import byte_tokenizer

    tok = byte_tokenizer()
    model = peaked("llama", seed=0, vocab_size=len(tok))
    engine = Engine(model, tok, max_batch_size=2, max_seq_len=64)
    free = engine.generate(
        [Request(tok("ab").input_ids, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))]
    )[0]
    text = tok.decode(free.response_tokens)
    stop = text[4:6]
    s = engine.generate(
        [
            Request(
                tok("ab").input_ids,
                SamplingParams(temperature=0, max_new_tokens=12, stop=[stop], ignore_eos=True),
            )
        ]
    )[0]
    assert s.status == Status.COMPLETED and stop in s.response and s.response_length < 12


def test_abort_keeps_tokens_so_far():
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=2, max_seq_len=64)
    for p in ([1, 2], [3, 4], [5, 6]):
        engine.add_request(Request(p, SamplingParams(max_new_tokens=50, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.abort_all()
    out = engine.step()
    assert len(out) == 3 and all(s.status == Status.ABORTED for s in out)
    # step 1: prefill samples a token and decode adds one; step 2: one more. The third never started.
    assert sorted(s.response_length for s in out) == [0, 3, 3]
    assert not engine.has_work()


def test_weight_update_mid_run_changes_outputs_and_versions():
    model = peaked("qwen3_moe", seed=0)
    new_weights = peaked("qwen3_moe", seed=9).state_dict()
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    baseline = Engine(peaked("qwen3_moe", seed=0), max_batch_size=4, max_seq_len=64).generate(
        [Request([1, 2, 3], params)]
    )[0]

    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    engine.add_request(Request([1, 2, 3], params))
    done = []
    for _ in range(4):
        done += engine.step()
    engine.update_weights(new_weights.items())
    assert engine.weight_version == 1
    engine.add_request(Request([1, 2, 3], params))
    while engine.has_work():
        done += engine.step()
    spanning, after = sorted(done, key=lambda s: s.metadata["request_id"])
    assert spanning.weight_versions == [0, 1]  # says it mixes versions
    assert after.weight_versions == [1]
    assert spanning.tokens[:7] == baseline.tokens[:7]  # 3 prompt + 4 tokens from version 0
    assert spanning.tokens != baseline.tokens
    # the new weights are in effect: a fresh engine on the new model gives the same as `after`
    fresh = Engine(peaked("qwen3_moe", seed=9), max_batch_size=4, max_seq_len=64).generate(
        [Request([1, 2, 3], params)]
    )[0]
    assert after.tokens == fresh.tokens
    # tokens after the update were computed from a cache refilled with the new weights
    ref = response_logprobs(peaked("qwen3_moe", seed=9), [spanning])[0]
    assert max(abs(a - b) for a, b in zip(spanning.rollout_log_probs[5:], ref[5:])) < 1e-5


def test_weight_update_from_another_thread_lands_between_steps():
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=4, max_seq_len=256)
    reqs = [Request([1, 2, i], SamplingParams(max_new_tokens=200, ignore_eos=True)) for i in range(4)]
    new = {k: v.clone() for k, v in peaked("llama", seed=4).state_dict().items()}
    result = {}
    t = threading.Thread(target=lambda: result.update(samples=engine.generate(reqs)))
    t.start()
    engine.update_weights(new.items(), version=7)
    t.join()
    assert engine.weight_version == 7
    assert all(s.weight_versions[-1] == 7 for s in result["samples"])
    assert torch.equal(model.state_dict()["model.norm.weight"], new["model.norm.weight"])


def test_bad_weight_update_changes_nothing():
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=1, max_seq_len=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = [("model.norm.weight", torch.zeros(64)), ("model.embed_tokens.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"embed_tokens.*shape \(3, 3\)"):
        engine.update_weights(bad)
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert engine.weight_version == 0


def test_group_prefill_is_shared_and_changes_nothing():
    """n copies of a prompt (a GRPO group) are prefilled once; each sample still equals its own
    run alone and the trainer's recomputation."""
    model = peaked("qwen3_moe", seed=8)
    ps = prompts(3, seed=2)
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=8, seed=100 * i + k, ignore_eos=True))
        for i, p in enumerate(ps)
        for k in range(4)
    ]
    engine = Engine(model, max_batch_size=16, max_seq_len=64)
    calls = []
    step = engine.decode_step
    original = step.prefill
    step.prefill = lambda ids, *a, **k: calls.append(ids.shape) or original(ids, *a, **k)
    samples = engine.generate(reqs)
    step.prefill = original
    assert calls[0][0] == 3  # one prefill row per distinct prompt, not 12
    for r, s in zip(reqs, samples):
        alone = Engine(model, max_batch_size=1, max_seq_len=64).generate([Request(r.prompt_ids, r.params)])[0]
        assert alone.tokens == s.tokens
        assert (alone.rollout_routed_experts == s.rollout_routed_experts).all()
    recomputed = response_logprobs(model, samples, temperature=1.0, replay_routing=True)
    assert max(abs(a - b) for s, r in zip(samples, recomputed) for a, b in zip(s.rollout_log_probs, r)) < 1e-5


def test_paused_holds_decoding_across_a_multi_part_update():
    """Buckets sent inside `engine.paused()` all land before the next decoding step, and the
    running requests' cache is recomputed once, not once per bucket."""
    model = peaked("llama", seed=0)
    engine = Engine(model, max_batch_size=2, max_seq_len=64)
    engine.add_request(Request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)))
    engine.step()
    refills = []
    real = engine._refill
    engine._refill = lambda states: refills.append(len(states)) or real(states)
    new = list(peaked("llama", seed=4).state_dict().items())
    progressed = []
    with engine.paused():
        engine.update_weights(new[: len(new) // 2], version=1)
        stepper = threading.Thread(target=lambda: progressed.append(len(engine.step())))
        stepper.start()
        stepper.join(timeout=0.3)
        assert stepper.is_alive()  # no step between the parts
        engine.update_weights(new[len(new) // 2 :], version=1)
    stepper.join(timeout=30)
    assert progressed == [0] and refills == [1]
    assert engine.weight_version == 1


def test_release_memory_frees_the_kv_cache_and_changes_no_output():
    """--colocate: between rollouts the engine gives its KV cache back; the next rollout
    allocates it again and generates exactly what an engine that kept it generates."""
    model = peaked("qwen3_moe", seed=3)
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=6, seed=i))
        for i, p in enumerate(prompts(5))
    ]
    kept, released = (
        Engine(model, max_batch_size=4, max_seq_len=64),
        Engine(model, max_batch_size=4, max_seq_len=64),
    )
    size = released.kv_cache_bytes
    assert size == 2 * 2 * 4 * 2 * 64 * 16 * 4  # K and V x layers x slots x kv heads x len x head dim x fp32
    assert released.release_memory() == size and released.kv_cache_bytes == 0
    assert released.release_memory() == 0  # nothing left to free
    first, again = kept.generate(reqs), released.generate(reqs)
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert released.kv_cache_bytes == size
    released.add_request(Request(prompts(1)[0], SamplingParams(max_new_tokens=4)))
    released.step()
    assert released.release_memory() == 0 and released.kv_cache_bytes == size  # busy: kept


def test_requests_beyond_the_kv_budget_wait_and_finish_as_they_would_alone(monkeypatch):
    """A KV budget of 60 tokens and 8 slots: each request reserves prompt + max_new_tokens (up to
    20 + 2..11 = 31 tokens), so at most two run at once and the rest wait in the queue; every
    request finishes, with the tokens and log-probs an engine with room for all gives it."""
    from miles.rollout import kv_budget

    model = peaked("llama", seed=4)
    ps = prompts(10, seed=2)
    params = SamplingParams(temperature=0.9, max_new_tokens=20, ignore_eos=True)
    roomy = Engine(model, max_batch_size=8, max_seq_len=32).generate(
        [Request(p, SamplingParams(**{**vars(params), "seed": i})) for i, p in enumerate(ps)]
    )
    per_token = model.kv_bytes_per_token()
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 60 * per_token * 2)  # x 0.5 = 60 tokens
    engine = Engine(model, max_batch_size=8, max_seq_len=32)
    assert engine.kv_budget.tokens == 60
    for i, p in enumerate(ps):
        engine.add_request(Request(p, SamplingParams(**{**vars(params), "seed": i})))
    done, most = [], 0
    while engine.has_work():
        done += engine.step()
        most = max(most, len(engine._running))
        assert engine._reserved <= 60
    assert 1 <= most <= 2 and len(done) == 10
    by_seed = {s.metadata["request_id"]: s for s in done}
    for i, ref in enumerate(roomy):
        got = by_seed[i]
        assert got.tokens == ref.tokens and got.rollout_log_probs == ref.rollout_log_probs


def test_a_context_that_cannot_fit_the_budget_is_refused_with_the_figures(monkeypatch):
    from miles.errors import MilesError
    from miles.rollout import kv_budget

    model = peaked("llama", seed=4)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 100 * model.kv_bytes_per_token())
    with pytest.raises(
        MilesError, match=r"one request of the engine's context \(64 tokens\) needs .* --mem-fraction"
    ):
        Engine(model, max_batch_size=8, max_seq_len=64)  # 64 tokens > 0.5 x 100
    Engine(model, max_batch_size=8, max_seq_len=64, mem_fraction_static=1.0)  # 64 <= 100: it fits


def test_the_cache_holds_memory_for_the_positions_written_and_gives_a_slot_back():
    """The KV cache of 8 slots x 4096 positions (48 MiB as address space): positions written make
    pages resident (256 bytes a position of one head: 16 a page), a released slot reads as zeros
    and holds nothing, and the other slots keep their values."""
    from miles.models.kv_cache import PAGE, KVCache

    cache = KVCache(num_layers=2, slots=8, kv_heads=2, max_len=4096, head_dim=64)
    assert cache.resident_bytes() == 0 and cache.nbytes == 2 * 2 * 8 * 2 * 4096 * 64 * 4
    k = torch.randn(3, 2, 100, 64)
    for layer in range(2):
        cache.write(layer, torch.tensor([0, 3, 5]), torch.arange(100).expand(3, 100), k, k)
    pages = 3 * 2 * -(-100 // 16) * 2 * 2  # slots x heads x pages a head x keys/values x layers
    assert cache.resident_bytes() == pages * PAGE
    keys, _ = cache.read(1, slice(0, 8), 100)
    assert torch.equal(keys[3], k[1]) and not keys[1].any()
    cache.release(3)
    assert cache.resident_bytes() == pages * PAGE * 2 // 3
    keys, _ = cache.read(1, slice(0, 8), 100)
    assert not keys[3].any() and torch.equal(keys[0], k[0]) and torch.equal(keys[5], k[2])
