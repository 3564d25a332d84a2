"""Computing each shared prompt once gives the full forward's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from miles.rollout import Engine, Request, SamplingParams
from miles.train import shared_prompt
from miles.train.batch import forward_logprobs, pack_samples
from miles.train.shared_prompt import padded_routing
from tests.conftest import ARCHS, random_model


def group_samples(model, n_prompts: int = 3, n: int = 4, seed: int = 0):
    """n samples per prompt, prompts and responses of different lengths (EOS ends some early)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (int(k),), generator=gen).tolist() for k in (5, 9, 2)[:n_prompts]]
    engine = Engine(model, max_batch_size=16, max_seq_len=64, seed=seed)
    requests = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=int(m), seed=i * n + k))
        for i, p in enumerate(prompts)
        for k, m in enumerate([1, 3, 6, 8][:n])
    ]
    return engine.generate(requests)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "arch, replay", [(a, False) for a in ARCHS] + [(a, True) for a in ARCHS if a.endswith("moe")]
)
def test_shared_prompt_forward_equals_the_full_forward(arch, replay, packed, monkeypatch):
    """Split (prompts, then responses on their keys and values) and packed (a group a row)
    layouts, each forced, give the full forward's log-probs, entropies, routing and gradients."""
    monkeypatch.setattr(shared_prompt, "PACK_RATIO", float("inf") if packed else 0.0)
    model = random_model(arch, seed=3)
    samples = group_samples(model)
    assert len({len(s.tokens) for s in samples}) > 2  # the padding is really exercised
    full_batch, shared_batch = (
        pack_samples(samples, replay),
        pack_samples(samples, replay, share_prompts=True),
    )
    assert full_batch.shared is None and shared_batch.shared is not None
    assert shared_batch.shared.prompt_ids.shape[0] == 3  # three distinct prompts, each run once
    assert (shared_batch.shared.group_ids is not None) == packed
    if packed:  # a row a group: each prompt once, then every response input token
        plan = shared_batch.shared
        assert plan.group_ids.shape[0] == 3
        assert int(plan.group_valid.sum()) == int(plan.prompt_mask.sum() + plan.resp_mask.sum())

    results = []
    # the plain forward with full logits (the oracle), then the LM head on response rows only,
    # plain and shared-prompt
    for batch, full_logits in ((full_batch, True), (full_batch, False), (shared_batch, False)):
        model.zero_grad()
        result = forward_logprobs(model.train(), batch, temperature=0.8, full_logits=full_logits)
        logp, out = result.logprobs, result.out
        mask = batch.response_mask
        loss = -(logp * mask * torch.linspace(-1, 1, mask.numel()).view_as(mask)).sum()
        loss = loss + 0.1 * (result.entropy * mask).sum()
        router_logits, _ = padded_routing(out)
        if router_logits:
            loss = loss + sum((r.softmax(-1)[..., 0] * batch.attention_mask).sum() for r in router_logits)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp * mask, result.entropy * mask, out, grads))
    (lp_a, ent_a, out_a, g_a) = results[0]
    for lp_b, ent_b, out_b, g_b in results[1:]:
        assert (lp_a - lp_b).abs().max() < 1e-5
        assert (ent_a - ent_b).abs().max() < 1e-4
        same_routing_and_grads(full_batch, out_a, out_b, g_a, g_b)


def same_routing_and_grads(full_batch, out_a, out_b, g_a, g_b) -> None:
    real = full_batch.attention_mask.bool()
    (logits_a, routed_a), (logits_b, routed_b) = padded_routing(out_a), padded_routing(out_b)
    if routed_a is not None:
        assert torch.equal(routed_a[real], routed_b[real])
        for ra, rb in zip(logits_a, logits_b):
            assert (ra[real] - rb[real]).abs().max() < 1e-4
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert (g_a[name] - g_b[name]).abs().max() < 1e-4 * max(1.0, g_a[name].abs().max()), name


def test_no_shared_prompt_means_the_plain_forward():
    model = random_model("qwen3_moe")
    samples = group_samples(model, n=1)
    assert pack_samples(samples, share_prompts=True).shared is None


@pytest.mark.parametrize("aux", [0.0, 0.01])
def test_packed_groups_log_the_routing_metrics_of_the_full_forward(aux, monkeypatch):
    """Under routing replay a packed group's router outputs stay one row a group position, each
    counted once for every sample it stands for: the load, entropy, mismatch and aux-loss
    figures of a training step are those of the forward that runs every sample whole."""
    from miles.config import make_config
    from miles.train.policy_trainer import PolicyTrainer

    monkeypatch.setattr(shared_prompt, "PACK_RATIO", float("inf"))
    samples = group_samples(random_model("qwen3_moe", seed=3))
    advantages = [torch.linspace(-1, 1, s.response_length) for s in samples]
    metrics = {}
    for share in (False, True):
        cfg = make_config(
            dict(rollout_batch_size=3, n_samples_per_prompt=4, micro_batch_size=12, lr=1e-30, use_r3=True,
                 share_prompts=share, aux_loss_coef=aux, eval_size=0, rollout_max_response_len=8)
        )  # fmt: skip
        metrics[share] = PolicyTrainer(random_model("qwen3_moe", seed=3).train(), cfg).train(
            samples, advantages
        )
    plain, packed = metrics[False], metrics[True]
    assert plain.keys() == packed.keys()
    moe = [k for k in plain if k.startswith(("expert_", "router_", "routing_", "aux_"))]
    assert "router_entropy" in moe and "routing_mismatch_frac" in moe and ("aux_loss" in moe) == (aux > 0)
    for k in plain:
        assert packed[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-7), k
