"""Pad-free training forwards (projections and MLPs on the real tokens alone, and the LM head on
response rows only) give the padded forward's loss and gradients, for every loss aggregation;
padding never reaches the loss."""

from __future__ import annotations

import pytest
import torch

from miles.algo.losses import policy_loss
from miles.algo.masked import AGG_MODES
from miles.data.sample import Sample
from miles.train import shared_prompt
from miles.train.batch import forward_logprobs, pack_samples
from miles.train.shared_prompt import padded_routing
from tests.conftest import random_model
from tests.test_shared_prompt import group_samples


def losses_and_grads(model, batch, pad_free: bool, agg: str, full_logits: bool = False):
    model.zero_grad()
    result = forward_logprobs(
        model.train(), batch, temperature=0.9, full_logits=full_logits, pad_free=pad_free
    )
    mask = batch.response_mask
    gen = torch.Generator().manual_seed(0)
    old = (result.logprobs.detach() + 0.1 * torch.cos(torch.arange(mask.shape[1]))) * mask  # by column
    adv = torch.randn(mask.shape[0], 1, generator=gen).expand_as(mask)
    loss = policy_loss(result.logprobs, old, adv, mask, agg=agg, norm_length=16).loss
    loss = loss - 0.01 * (result.entropy * mask).sum() / mask.sum()
    router_logits, _ = padded_routing(result.out)
    if router_logits:
        loss = loss + sum((r.softmax(-1)[..., 0] * batch.attention_mask).mean() for r in router_logits)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), result.logprobs * mask, grads


@pytest.mark.parametrize(
    "arch, share",
    [(a, s) for a in ("qwen3", "qwen3_moe") for s in ("no", "split", "packed")],
)
def test_pad_free_gives_the_padded_loss_and_gradients(arch, share, monkeypatch):
    """Plain rows, shared prompts split (two passes) and packed (a group a row)."""
    monkeypatch.setattr(shared_prompt, "PACK_RATIO", float("inf") if share == "packed" else 0.0)
    model = random_model(arch, seed=5)
    samples = group_samples(model, n_prompts=3, n=4, seed=1)
    batch = pack_samples(samples, replay_routing=arch.endswith("moe"), share_prompts=share != "no")
    plan = batch.shared
    if share == "no":  # every row's real tokens
        real_tokens = int(batch.attention_mask.sum())
    else:  # each prompt once, then every response token
        assert (plan.group_ids is not None) == (share == "packed")
        real_tokens = int(plan.prompt_mask.sum() + plan.resp_mask.sum())
    rows = []  # what the first layer's q_proj is given
    q_proj = model.model.layers[0].self_attn.q_proj
    real = q_proj.forward
    monkeypatch.setattr(q_proj, "forward", lambda x: rows.append(x.shape[:-1]) or real(x))
    for agg in AGG_MODES:
        rows.clear()
        padded = losses_and_grads(model, batch, False, agg)
        assert sum(r.numel() for r in rows) > real_tokens  # padding ran
        rows.clear()
        pad_free = losses_and_grads(model, batch, True, agg)
        assert [len(r) for r in rows] == [1] * len(rows) and sum(r[0] for r in rows) == real_tokens
        assert abs(padded[0] - pad_free[0]) < 1e-5, agg
        assert (padded[1] - pad_free[1]).abs().max() < 1e-5, agg
        assert padded[2].keys() == pad_free[2].keys()
        for name, g in padded[2].items():
            assert (g - pad_free[2][name]).abs().max() < 1e-5 * max(1.0, g.abs().max()), (agg, name)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("share", ["no", "packed"])
@pytest.mark.parametrize("pad_free", [False, True])
def test_last_layer_mlp_on_the_head_rows_alone_gives_the_full_forward(arch, share, pad_free, monkeypatch):
    """With the LM head on the response rows, the last layer's MLP (or experts) runs on the rows
    the head reads alone; the loss and every gradient equal the forward that computes the logits
    of every position (router terms included: every row is still routed)."""
    monkeypatch.setattr(shared_prompt, "PACK_RATIO", float("inf"))
    model = random_model(arch, seed=6)
    samples = group_samples(model, n_prompts=3, n=4, seed=2)
    batch = pack_samples(samples, replay_routing=arch.endswith("moe"), share_prompts=share != "no")
    seen = {}  # rows given to the first and the last layer's MLP (an expert's: summed over experts)

    def spy(name, module):
        real = module.forward
        monkeypatch.setattr(
            module,
            "forward",
            lambda x: seen.__setitem__(name, seen.get(name, 0) + len(x.reshape(-1, x.shape[-1]))) or real(x),
        )

    layers = model.model.layers
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        for module in getattr(layer.mlp, "experts", [layer.mlp]):
            spy(name, module)
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        seen.clear()
        full = losses_and_grads(model, batch, pad_free, agg, full_logits=True)
        assert seen["last"] == seen["first"]
        seen.clear()
        head = losses_and_grads(model, batch, pad_free, agg)
        assert seen["last"] < 0.8 * seen["first"]  # the prompts' rows (but each last one) skipped
        assert abs(full[0] - head[0]) < 1e-5, agg
        assert (full[1] - head[1]).abs().max() < 1e-5, agg
        assert full[2].keys() == head[2].keys()
        for name, g in full[2].items():
            assert (g - head[2][name]).abs().max() < 1e-5 * max(1.0, g.abs().max()), (agg, name)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("pad_free", [False, True])
def test_one_token_responses_train_with_shared_prompts(pad_free, packed, monkeypatch):
    """Every response a single token (an immediate EOS): the responses' pass (split layout) has
    no input token at all; the loss and gradients are still the plain forward's."""
    monkeypatch.setattr(shared_prompt, "PACK_RATIO", float("inf") if packed else 0.0)
    model = random_model("qwen3_moe", seed=4)
    one = [
        Sample(tokens=s.tokens[: s.prompt_length + 1], response_length=1,
               rollout_routed_experts=s.rollout_routed_experts[: s.prompt_length])
        for s in group_samples(model, n_prompts=2, n=4, seed=2)
    ]  # fmt: skip
    shared = pack_samples(one, replay_routing=True, share_prompts=True)
    assert shared.shared is not None and not shared.shared.resp_mask.any()
    for agg in AGG_MODES:
        want = losses_and_grads(model, pack_samples(one, replay_routing=True), False, agg)
        got = losses_and_grads(model, shared, pad_free, agg)
        assert abs(want[0] - got[0]) < 1e-5 and (want[1] - got[1]).abs().max() < 1e-5, agg
        for name, g in want[2].items():
            assert (g - got[2][name]).abs().max() < 1e-5 * max(1.0, g.abs().max()), (agg, name)


@pytest.mark.parametrize("pad_free", [False, True])
def test_padding_never_reaches_the_loss(pad_free):
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
        a, b = losses_and_grads(model, clean, pad_free, agg), losses_and_grads(model, dirty, pad_free, agg)
        assert abs(a[0] - b[0]) < 1e-6, agg
        for name, g in a[2].items():
            assert (g - b[2][name]).abs().max() < 1e-6 * max(1.0, g.abs().max()), (agg, name)
