"""Training forwards in length buckets (and with the LM head on response rows only) give the
padded forward's loss and gradients, for every loss aggregation; padding never reaches the loss."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import miles.train.length_buckets as lb
from miles.algo.losses import policy_loss
from miles.algo.masked import AGG_MODES
from miles.train.batch import forward_logprobs, pack_samples
from tests.conftest import random_model
from tests.test_shared_prompt import group_samples


def brute_force_cost(lengths: list[int], overhead: int) -> float:
    """The least cost over every way of cutting the length-sorted rows into consecutive buckets."""
    ordered = sorted(lengths, reverse=True)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        cost, start = 0, 0
        for k, cut in enumerate([*cuts, True]):
            if cut:
                cost += (k + 1 - start) * ordered[start] + overhead
                start = k + 1
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_bucket_plan_is_the_cheapest_cut(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 4, 9, 16, 17, 40]) for _ in range(rng.randint(1, 11))]
    overhead = rng.choice([0, 5, 30])
    buckets = lb.plan_buckets(lengths, overhead)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))  # each row once
    cost = sum(len(b) * max(lengths[i] for i in b) + overhead for b in buckets)
    assert cost == brute_force_cost(lengths, overhead)


def losses_and_grads(model, batch, buckets: bool, agg: str):
    model.zero_grad()
    result = forward_logprobs(model.train(), batch, temperature=0.9, buckets=buckets)
    mask = batch.response_mask
    gen = torch.Generator().manual_seed(0)
    old = (result.logprobs.detach() + 0.1 * torch.cos(torch.arange(mask.shape[1]))) * mask  # by column
    adv = torch.randn(mask.shape[0], 1, generator=gen).expand_as(mask)
    loss = policy_loss(result.logprobs, old, adv, mask, agg=agg, norm_length=16).loss
    loss = loss - 0.01 * (result.entropy * mask).sum() / mask.sum()
    if result.out.router_logits:
        loss = loss + sum(
            (r.softmax(-1)[..., 0] * batch.attention_mask).mean() for r in result.out.router_logits
        )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), result.logprobs * mask, grads


@pytest.mark.parametrize("arch, share", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_buckets_give_the_padded_loss_and_gradients(arch, share, monkeypatch):
    model = random_model(arch, seed=5)
    samples = group_samples(model, n_prompts=3, n=4, seed=1)
    batch = pack_samples(samples, replay_routing=arch.endswith("moe"), share_prompts=share)
    monkeypatch.setattr(lb, "FORWARD_OVERHEAD_FLOPS", 0.0)  # every distinct length its own bucket
    calls = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    for agg in AGG_MODES:
        padded = losses_and_grads(model, batch, False, agg)
        calls.clear()
        bucketed = losses_and_grads(model, batch, True, agg)
        assert len(calls) > 2  # several buckets really ran
        assert abs(padded[0] - bucketed[0]) < 1e-5, agg
        assert (padded[1] - bucketed[1]).abs().max() < 1e-5, agg
        assert padded[2].keys() == bucketed[2].keys()
        for name, g in padded[2].items():
            assert (g - bucketed[2][name]).abs().max() < 1e-5 * max(1.0, g.abs().max()), (agg, name)


@pytest.mark.parametrize("buckets", [False, True])
def test_padding_never_reaches_the_loss(buckets):
    """Garbage tokens in every padded position and extra padded columns change nothing."""
    model = random_model("qwen3", seed=2)
    samples = group_samples(model, n_prompts=2, n=4, seed=3)
    clean = pack_samples(samples, share_prompts=False)
    dirty = pack_samples(samples, share_prompts=False)
    B, T = clean.input_ids.shape
    width = T + 7
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (B, width), generator=gen)
    ids[:, :T] = torch.where(clean.attention_mask.bool(), clean.input_ids, ids[:, :T])
    pad = lambda t: torch.cat([t, t.new_zeros(B, width - T)], dim=1)  # noqa: E731
    dirty.input_ids, dirty.targets = ids, pad(clean.targets)
    dirty.attention_mask, dirty.response_mask = pad(clean.attention_mask), pad(clean.response_mask)
    dirty.response_rows = (clean.response_rows // T) * width + clean.response_rows % T
    for agg in AGG_MODES:
        a, b = losses_and_grads(model, clean, buckets, agg), losses_and_grads(model, dirty, buckets, agg)
        assert abs(a[0] - b[0]) < 1e-6, agg
        for name, g in a[2].items():
            assert (g - b[2][name]).abs().max() < 1e-6 * max(1.0, g.abs().max()), (agg, name)
