"""MoE at scale, in one process: the load-balancing loss, expert capacity, batch-invariant
routing and the load metrics (expert parallelism and offload: tests/test_expert_parallel.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.models.routing import (
    RoutingOptions,
    apply_routing,
    capacity,
    decode_experts,
    dropped,
    keep_within_capacity,
)
from miles.rollout import Engine, Request, SamplingParams
from miles.train.moe_stats import load_balancing_loss, load_metrics, routing_counts
from tests.conftest import random_model


def megatron_aux(probs: torch.Tensor, experts: torch.Tensor, E: int, k: int) -> torch.Tensor:
    """Megatron's switch_load_balancing_loss_func written out: sum(P_sum * tokens_per_expert) * E / (T * T * k)."""
    T = probs.shape[0]
    tokens_per_expert = torch.zeros(E)
    for e in experts.reshape(-1).tolist():
        tokens_per_expert[e] += 1
    return (probs.sum(0) * tokens_per_expert).sum() * E / (T * T * k)


def test_aux_loss_is_megatrons_formula_and_hf_is_top_k_times_it():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    E, k, B, T = 6, 2, 3, 7
    logits = torch.randn(B, T, E) * 2
    experts = logits.topk(k, -1).indices
    mask = torch.ones(B, T)
    chosen, kept = routing_counts(experts[:, :, None], mask, E)
    ours = load_balancing_loss([logits], mask, chosen)
    probs = logits.reshape(-1, E).softmax(-1)
    torch.testing.assert_close(ours, megatron_aux(probs, experts, E, k).float())
    # by hand for one layer: E * sum_i (count_i / (T k)) * mean_t p_ti
    counts = torch.bincount(experts.reshape(-1), minlength=E).float()
    torch.testing.assert_close(ours, E * ((counts / (B * T * k)) * probs.mean(0)).sum())
    hf = load_balancing_loss_func((logits.reshape(-1, E),), E, k)
    torch.testing.assert_close(hf, k * ours)
    # uniform routing: exactly 1; collapsed onto k experts with confident probs: near E / k
    flat = torch.zeros(B, T, E)
    assert math.isclose(float(load_balancing_loss([flat], mask, torch.ones(1, E))), 1.0, rel_tol=1e-6)
    collapsed = torch.full((B, T, E), -30.0)
    collapsed[..., :k] = 0
    counts = torch.zeros(1, E)
    counts[0, :k] = B * T
    assert math.isclose(float(load_balancing_loss([collapsed], mask, counts)), E / k, rel_tol=1e-4)


def test_aux_loss_layers_average_and_padding_is_ignored():
    torch.manual_seed(1)
    E, k = 4, 2
    logits = [torch.randn(2, 5, E), torch.randn(2, 5, E)]
    record = torch.stack([lg.topk(k, -1).indices for lg in logits], dim=2)  # (B, T, L, k)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    chosen, _ = routing_counts(record, mask, E)
    total = load_balancing_loss(logits, mask, chosen)
    each = [
        load_balancing_loss([lg[mask.bool()][None]], torch.ones(1, int(mask.sum())), chosen[i : i + 1])
        for i, lg in enumerate(logits)
    ]
    torch.testing.assert_close(total, (each[0] + each[1]) / 2)


def brute_force_keep(experts, scores, valid, E, factor, policy):
    """The capacity rule slot by slot: per expert, sort its real slots by (-prob, slot) or (slot)."""
    N, K = experts.shape
    cap = math.ceil(int(valid.sum()) * K / E * factor)
    keep = torch.zeros(N, K, dtype=torch.bool)
    for e in range(E):
        slots = [(n, j) for n in range(N) for j in range(K) if valid[n] and experts[n, j] == e]
        if policy == "probs":
            slots.sort(key=lambda s: (-float(scores[s]), s[0] * K + s[1]))
        for n, j in slots[:cap]:
            keep[n, j] = True
    return keep


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    E=st.integers(2, 8),
    factor=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]),
    policy=st.sampled_from(["probs", "position"]),
    seed=st.integers(0, 10_000),
)
def test_capacity_drops_exactly_the_right_slots(n, E, factor, policy, seed):
    gen = torch.Generator().manual_seed(seed)
    K = min(2, E)
    probs = torch.randint(0, 5, (n, E), generator=gen).float().softmax(-1)  # many ties
    experts = probs.topk(K, -1).indices
    scores = probs.gather(-1, experts)
    valid = torch.rand(n, generator=gen) > 0.2
    keep = keep_within_capacity(experts, scores, valid, E, factor, policy)
    assert torch.equal(keep, brute_force_keep(experts, scores, valid, E, factor, policy))
    per_expert = torch.bincount(experts[keep], minlength=E)
    assert int(per_expert.max()) <= capacity(int(valid.sum()), K, E, factor)


def moe_layer(model):
    return next(layer.mlp for layer in model.model.layers if layer.is_moe)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_capacity_unset_is_bitwise_dropless_and_dropped_slots_add_nothing(arch):
    model = random_model(arch)
    ids = torch.randint(0, 97, (4, 9))
    with torch.no_grad():
        plain = model(ids)
        apply_routing(model, RoutingOptions(capacity_factor=model.config.num_experts))  # room for every slot
        roomy = model(ids)
        assert torch.equal(plain.logits, roomy.logits) and not dropped(roomy.routed_experts).any()
        # a tight capacity: each layer's output is the weighted sum of its kept experts only
        apply_routing(model, RoutingOptions(capacity_factor=0.5, drop_policy="probs"))
        moe = moe_layer(model)
        x = torch.randn(12, model.config.hidden_size)
        out, logits, record = moe(x, None)
        assert dropped(record).any()
        probs = logits.softmax(-1)
        experts = decode_experts(record)
        w = probs.gather(-1, experts)
        if moe.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        expect = torch.zeros_like(x)
        for n in range(12):
            for j in range(record.shape[1]):
                if not dropped(record[n, j]):
                    expect[n] += w[n, j] * moe.experts[int(experts[n, j])](x[n : n + 1])[0]
        if moe.shared_expert is not None:
            expect += torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
        torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-5)


def test_replay_carries_the_engines_drops():
    """A record with drops, replayed in another batch layout, reproduces the output exactly."""
    model = random_model("qwen3_moe")
    apply_routing(model, RoutingOptions(capacity_factor=0.75))
    ids = torch.randint(0, 97, (3, 8))
    with torch.no_grad():
        first = model(ids)
        assert dropped(first.routed_experts).any()
        alone = model(ids[1:2], forced_experts=first.routed_experts[1:2])  # its own capacity would differ
    assert torch.equal(alone.routed_experts, first.routed_experts[1:2])
    torch.testing.assert_close(alone.logits, first.logits[1:2], atol=1e-5, rtol=1e-5)


def embed(seq, B, T, row, seed):
    """`seq` placed in row `row` of a (B, T) batch of random other sequences of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 97, (B, T), generator=gen)
    mask = (torch.arange(T)[None] < torch.randint(2, T + 1, (B, 1), generator=gen)).long()
    batch[row, : len(seq)] = seq
    mask[row] = 0
    mask[row, : len(seq)] = 1
    return batch, mask


def test_deterministic_routing_is_batch_invariant_in_the_trainer_forward():
    model = random_model("qwen3_moe", num_hidden_layers=3)
    apply_routing(model, RoutingOptions(deterministic=True))
    seq = torch.randint(0, 97, (21,))
    with torch.no_grad():
        alone = model(seq[None])
        for B, T, row in ((16, 30, 5), (64, 80, 40)):
            batch, mask = embed(seq, B, T, row, seed=B)
            out = model(batch, attention_mask=mask)
            assert torch.equal(out.routed_experts[row, :21], alone.routed_experts[0])
            assert torch.equal(out.logits[row, :21].log_softmax(-1), alone.logits[0].log_softmax(-1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_deterministic_routing_holds_for_every_row_of_a_large_ragged_batch(arch):
    """Rows of a 64 x 48 batch of random lengths, each scored alone: bitwise the same routing and
    log-probs. (Large enough that CPU elementwise kernels split over threads: their scalar tails
    once made the last rows of an expert's slice round differently.)"""
    model = random_model(arch)
    apply_routing(model, RoutingOptions(deterministic=True))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (64, 48), generator=gen)
    lengths = torch.randint(16, 49, (64,), generator=gen)
    mask = (torch.arange(48)[None] < lengths[:, None]).long()
    with torch.no_grad():
        batch = model(ids, attention_mask=mask)
        for row in range(0, 64, 7):
            n = int(lengths[row])
            alone = model(ids[row : row + 1, :n])
            assert torch.equal(batch.routed_experts[row, :n], alone.routed_experts[0])
            assert torch.equal(batch.logits[row, :n].log_softmax(-1), alone.logits[0].log_softmax(-1))


def test_deterministic_routing_is_batch_invariant_in_the_engine():
    model = random_model("qwen3_moe")
    model.init_weights(std=0.15, seed=3)
    apply_routing(model, RoutingOptions(deterministic=True))
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7, ignore_eos=True)
    alone = Engine(model, max_batch_size=1, max_seq_len=40).generate([Request(prompt, params)])[0]
    others = [Request([9 + i] * (2 + i % 9), SamplingParams(max_new_tokens=3 + i % 5)) for i in range(15)]
    crowd = Engine(model, max_batch_size=16, max_seq_len=40).generate(
        others[:7] + [Request(prompt, params)] + others[7:]
    )[7]
    assert crowd.tokens == alone.tokens
    assert crowd.rollout_log_probs == alone.rollout_log_probs
    assert (crowd.rollout_routed_experts == alone.rollout_routed_experts).all()


def test_load_metrics_by_hand():
    kept = torch.tensor([[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    chosen = kept + torch.tensor([[2.0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    m = load_metrics(chosen, kept, torch.tensor([0.5, 1.5], dtype=torch.float64), tokens=8)
    assert m["expert_load_max_over_mean_l0"] == 3.0 and m["expert_load_max_over_mean_l1"] == 1.0
    assert m["expert_layer_load_max_over_mean"] == 2.0
    assert m["expert_load_max_over_balanced"] == pytest.approx((6 / 2.5 + 2 / 2) / 2)  # chosen spread evenly
    assert m["expert_load_max_over_mean"] == 8.0 / 4.0  # pooled: [8, 4, 2, 2]
    assert m["expert_idle_frac"] == 2 / 8
    assert m["expert_dropped_frac"] == pytest.approx(2 / 18)
    assert m["router_entropy"] == pytest.approx(2.0 / 16)
    assert m["expert_share_e0"] == pytest.approx(0.5)


def test_r3_buffer_is_bounded_compact_and_names_the_size_that_fits():
    import numpy as np

    from miles.data.sample import Sample
    from miles.errors import MilesError
    from miles.rollout.routing_buffer import RoutingBuffer

    rng = np.random.default_rng(0)
    samples = []
    for i in range(10):
        s = Sample(tokens=list(range(6 + i)), response_length=3)
        record = rng.integers(-9, 8, size=(5 + i, 2, 2)).astype(np.int32)  # drops down to -(7 + 2)
        s.rollout_routed_experts = record
        samples.append((s, record.copy()))
    buf = RoutingBuffer(capacity=4, n_experts=8)
    buf.store(s for s, _ in samples)
    assert len(buf.records) == 4 and buf.evicted == 6
    assert all(r.dtype == np.int8 for r in buf.records.values())
    assert buf.nbytes == sum(r.nbytes // 4 for _, r in samples[6:])  # 1 byte per slot instead of 4
    assert all(s.rollout_routed_experts is None for s, _ in samples)
    buf.take([s for s, _ in samples[6:]], in_flight=10)
    for s, r in samples[6:]:
        assert np.array_equal(s.rollout_routed_experts.astype(np.int32), r)
    assert not buf.records
    with pytest.raises(MilesError, match="evicted before it was trained.*--r3-buffer-size 10 or more"):
        buf.take([samples[0][0]], in_flight=10)


def test_r3_buffer_in_miles_train(tmp_path):
    """A run with --use-r3 --r3-buffer-size reports the records' memory and replays them (no
    routing mismatch in the used experts: the log-prob gap stays at float rounding); a buffer
    smaller than one rollout stops the run with the size that fits."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.errors import MilesError
    from miles.run import train
    from tests.conftest import small_run_args

    args = small_run_args(tmp_path / "ok", 1) + ["--use-r3", "--r3-buffer-size", "16", "--eval-interval", "0"]
    train(load_config(args))
    (step,) = [r for r in read_metrics(tmp_path / "ok") if r["rollout"] == 0]
    assert step["r3_buffer_evicted"] == 0 and 0 < step["r3_buffer_peak_mb"] < 0.01
    assert step["train_rollout_logprob_abs_diff"] < 1e-4
    small = small_run_args(tmp_path / "small", 1) + [
        "--use-r3",
        "--r3-buffer-size",
        "8",
        "--eval-interval",
        "0",
    ]
    with pytest.raises(MilesError, match="--r3-buffer-size 16 or more"):
        train(load_config(small))


@pytest.mark.parametrize("kind", ["micro_batch", "global"])
def test_trainer_aux_loss_counts_per_micro_batch_or_pooled_over_the_step(kind):
    """The logged aux loss of a step with two micro-batches equals the formula by hand: f from each
    micro-batch's own counts, or (global) from the counts of the step so far."""
    from miles.train.batch import pack_samples
    from miles.train.policy_trainer import PolicyTrainer, loss_denominator
    from tests.test_grad_accumulation import N_SAMPLES, config, make_samples

    samples, advantages = make_samples()
    model = random_model("qwen3_moe").train()
    cfg = config("token-mean", N_SAMPLES // 2, aux_loss_coef=0.01, moe_aux_loss_type=kind)
    expected, pooled = 0.0, None
    denominator = loss_denominator(samples, "token-mean")
    with torch.no_grad():
        for half in (samples[: N_SAMPLES // 2], samples[N_SAMPLES // 2 :]):
            batch = pack_samples(half)
            out = model(batch.input_ids, attention_mask=batch.attention_mask)
            chosen, _ = routing_counts(out.routed_experts, batch.attention_mask, 4)
            pooled = chosen if pooled is None else pooled + chosen
            counts = pooled if kind == "global" else chosen
            aux = load_balancing_loss(out.router_logits, batch.attention_mask, counts)
            expected += float(aux) * loss_denominator(half, "token-mean") / denominator
    metrics = PolicyTrainer(model, cfg).train(samples, advantages)
    assert metrics["aux_loss"] == pytest.approx(expected, rel=1e-5)


def test_batch_invariant_combine_sums_each_tokens_experts_in_a_fixed_order():
    """With `slot` (batch-invariant routing) the experts' outputs are summed per token in k order,
    not by index_add (atomics on CUDA): the same sum, the same gradients, dropped slots adding
    nothing, with top_k = 4 where the order of three or more addends changes the rounding."""
    moe = moe_layer(random_model("qwen3_moe", num_experts_per_tok=4))
    N, K = 10, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, moe.gate.weight.shape[1], generator=gen, requires_grad=True)
    expert = torch.stack([torch.randperm(moe.num_experts, generator=gen)[:K] for _ in range(N)]).reshape(-1)
    weight = torch.rand(N * K, generator=gen)
    kept = torch.rand(N * K, generator=gen) > 0.25
    slot = torch.arange(N * K)[kept]
    token, expert, weight = slot // K, expert[kept], weight[kept]
    ordered = moe._dispatch(x, token, expert, weight, slot)
    (grad_ordered,) = torch.autograd.grad(ordered.square().sum(), x)
    atomic = moe._dispatch(x, token, expert, weight)
    (grad_atomic,) = torch.autograd.grad(atomic.square().sum(), x)
    expect = torch.zeros(N, x.shape[1])
    for s, e, w in zip(slot.tolist(), expert.tolist(), weight.tolist()):
        expect[s // K] += w * moe.experts[e](x[s // K : s // K + 1])[0].detach()
    torch.testing.assert_close(ordered.detach(), expect, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ordered, atomic, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_ordered, grad_atomic, atol=1e-6, rtol=1e-5)
