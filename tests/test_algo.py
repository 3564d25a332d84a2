"""miles.algo against hand-worked examples (arithmetic in comments) and invariants."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.algo import advantages as A
from miles.algo.filters import apply_filter, nonconstant_reward
from miles.algo.logprobs import entropy, head_logprobs, tempered, token_logprobs
from miles.algo.losses import kl_estimate, policy_loss, value_loss
from miles.algo.masked import AGG_MODES, aggregate, masked_mean, masked_var, whiten
from miles.algo.mismatch import importance_weights, mismatch_metrics, routing_mismatch
from miles.rollout.sampling import scale_by_temperature

close = torch.testing.assert_close


# ---------------- advantages ----------------


def test_grpo_hand_example():
    # group 1: rewards 1,0,0,1: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> +-.5/.57735 = +-.866025
    # group 2: all equal -> 0
    adv = A.grpo(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), group_size=4)
    close(adv, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    # Dr.GRPO: no std division -> +-.5
    close(A.grpo(torch.tensor([1.0, 0, 0, 1]), 4, std_normalize=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_grpo_groups_sum_to_zero(groups, size, seed):
    rewards = torch.rand(groups * size, generator=torch.Generator().manual_seed(seed))
    g = rewards.view(groups, size)
    for norm in (True, False):
        adv = A.grpo(rewards, size, std_normalize=norm).view(groups, size)
        # times the group's divisor, the sum is that of the centred rewards: 0 up to fp32 rounding
        # (a near-tie group's small std magnifies the rounding, so the sum itself is not bounded)
        divisor = g.std(-1) + 1e-6 if norm and size > 1 else torch.ones(groups)
        assert (adv.sum(-1) * divisor).abs().max() <= size * 2**-23


def test_rloo_hand_example():
    # A_0 = 1 - (0+0)/2 = 1; A_1 = 0 - (1+0)/2 = -.5; A_2 = -.5
    close(A.rloo(torch.tensor([1.0, 0, 0]), 3), torch.tensor([1.0, -0.5, -0.5]))


def test_reinforce_plus_plus_hand_example():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])  # 9.0 sits on padding
    # token rewards (kl_coef .1): row 0 [-.01, -.02, -.03 + 1] ; row 1 [-.05, -.05]
    tr = A.last_token_rewards(rewards, mask) - 0.1 * kl * mask
    close(tr, torch.tensor([[-0.01, -0.02, 0.97], [-0.05, -0.05, 0.0]]))
    # returns (gamma 1): row 0 [.94, .95, .97]; row 1 [-.10, -.05]
    returns = A.discounted_returns(tr, mask)
    close(returns, torch.tensor([[0.94, 0.95, 0.97], [-0.10, -0.05, 0.0]]))
    # gamma .5: row 0: G2 = .97, G1 = -.02 + .485 = .465, G0 = -.01 + .2325 = .2225
    close(A.discounted_returns(tr, mask, gamma=0.5)[0], torch.tensor([0.2225, 0.465, 0.97]))
    adv = A.reinforce_plus_plus(rewards, kl, mask, kl_coef=0.1)
    vals = torch.tensor([0.94, 0.95, 0.97, -0.10, -0.05])
    close(adv[mask.bool()], (vals - vals.mean()) / vals.std(), atol=1e-5, rtol=1e-5)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_subtracts_group_mean():
    mask = torch.ones(4, 2)
    kl = torch.zeros(4, 2)
    # rewards 3,1 | 5,5 -> baselined 1,-1 | 0,0 -> returns equal per token; whitened
    adv = A.reinforce_plus_plus_baseline(torch.tensor([3.0, 1, 5, 5]), 2, kl, mask, kl_coef=0.1)
    base = A.reinforce_plus_plus(torch.tensor([1.0, -1, 0, 0]), kl, mask, kl_coef=0.1)
    close(adv, base)
    assert adv[0, 0] > 0 > adv[1, 0] and abs(adv[2, 0]) < 1e-6


def test_gae_hand_example():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    # gamma=lam=1: d2 = 1 - .7 = .3; d1 = .7 - .6 = .1; d0 = .6 - .5 = .1 -> A = [.5, .4, .3], R = A + V = 1
    adv, ret = A.gae(r, v, m)
    close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    close(ret, torch.ones(1, 3))
    # gamma .9, lam .5: d2 = .3; d1 = .9*.7 - .6 = .03; d0 = .9*.6 - .5 = .04
    # A2 = .3; A1 = .03 + .45*.3 = .165; A0 = .04 + .45*.165 = .11425
    adv, _ = A.gae(r, v, m, gamma=0.9, lam=0.5)
    close(adv, torch.tensor([[0.11425, 0.165, 0.3]]))
    # right padding does not change the real tokens' advantages
    adv_pad, _ = A.gae(
        torch.tensor([[0.0, 0, 1, 5]]), torch.tensor([[0.5, 0.6, 0.7, 9]]), torch.tensor([[1, 1, 1, 0]])
    )
    close(adv_pad[:, :3], torch.tensor([[0.5, 0.4, 0.3]]))
    assert adv_pad[0, 3] == 0


def test_whiten_over_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = whiten(x, m)
    real = w[m.bool()]
    assert abs(float(real.mean())) < 1e-6 and abs(float(real.std()) - 1) < 1e-3
    assert w[1, 1] == 0 and w[1, 2] == 0


# ---------------- policy loss ----------------

LOGP_OLD = torch.zeros(1, 4)
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 3.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
MASK = torch.ones(1, 4)


def test_ppo_clip_hand_example():
    # a: r 1.5, A +1: max(-1.5, -1.2) = -1.2 (clipped)
    # b: r 0.5, A +1: max(-0.5, -0.8) = -0.5
    # c: r 0.5, A -1: max(0.5, 0.8) = 0.8 (clipped)
    # d: r 3.0, A -1: max(3.0, 1.2) = 3.0
    out = policy_loss(RATIOS.log(), LOGP_OLD, ADV, MASK, eps_clip=0.2)
    close(out.loss, torch.tensor((-1.2 - 0.5 + 0.8 + 3.0) / 4))
    close(out.clipfrac, torch.tensor(0.5))
    # dual clip c = 2.5 bounds d at 2.5: (-1.2 - .5 + .8 + 2.5) / 4 = .4
    dual = policy_loss(RATIOS.log(), LOGP_OLD, ADV, MASK, eps_clip=0.2, eps_clip_c=2.5)
    close(dual.loss, torch.tensor(0.4))
    close(dual.dual_clipfrac, torch.tensor(0.25))
    # clip-higher eps_high .28: a becomes -1.28
    high = policy_loss(RATIOS.log(), LOGP_OLD, ADV, MASK, eps_clip=0.2, eps_clip_high=0.28)
    close(high.loss, torch.tensor((-1.28 - 0.5 + 0.8 + 3.0) / 4))


@pytest.mark.parametrize("dual", [None, 2.5])
def test_clipping_zeroes_gradient_exactly_where_it_should(dual):
    logp = RATIOS.log().clone().requires_grad_(True)
    policy_loss(logp, LOGP_OLD, ADV, MASK, eps_clip=0.2, eps_clip_c=dual).loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[2] == 0  # clipped tokens
    # b: d/dlogp of -A*r/4 = -r/4 = -.125 ; d: +r/4 = .75 unless dual-clipped
    close(g[1], torch.tensor(-0.125))
    close(g[3], torch.tensor(0.0 if dual else 0.75))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.sampled_from(AGG_MODES), st.integers(0, 10_000))
def test_ratio_one_gives_minus_mean_advantage(B, T, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    out = policy_loss(logp, logp.clone(), adv, mask, eps_clip=0.2, agg=mode)
    close(out.loss, aggregate(-adv, mask, mode))
    assert out.clipfrac == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 6), st.sampled_from(AGG_MODES), st.integers(0, 10_000))
def test_padding_never_changes_a_loss(B, T, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    logp, old, adv = (torch.randn(B, T, generator=gen) * 0.3 for _ in range(3))
    mask = (torch.rand(B, T, generator=gen) > 0.4).float()
    mask[:, 0] = 1
    pad = ~mask.bool()
    garbage = [t.masked_fill(pad, v) for t, v in zip((logp, old, adv), (50.0, float("nan"), float("inf")))]
    for ratio_type in ("token", "sequence"):
        a = policy_loss(logp, old, adv, mask, agg=mode, ratio_type=ratio_type, eps_clip_c=3.0)
        b = policy_loss(*garbage, mask, agg=mode, ratio_type=ratio_type, eps_clip_c=3.0)
        close(a.loss, b.loss)
    vals = torch.randn(B, T, generator=gen)
    close(
        value_loss(vals, vals * 0.5, adv, mask, agg=mode)[0],
        value_loss(vals, vals * 0.5, garbage[2], mask, agg=mode)[0],
    )
    close(masked_mean(kl_estimate(logp, old), mask), masked_mean(kl_estimate(garbage[0], garbage[1]), mask))


def test_aggregation_modes_hand_example():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), torch.tensor(10 / 4))  # (1+2+3+4)/4
    close(aggregate(loss, mask, "seq-mean-token-mean"), torch.tensor(3.0))  # (2 + 4)/2
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", 3), torch.tensor((6 / 3 + 4 / 3) / 2))
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", 10), torch.tensor((6 / 10 + 4 / 10) / 2))
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss, mask, "mean")


def test_gspo_sequence_ratio_hand_example():
    # logp - old = [.1, .3] -> mean .2 -> s = e^.2 = 1.2214 -> clipped at 1 + 4e-4 for A = +1
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    out = policy_loss(
        logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4, ratio_type="sequence"
    )
    close(out.loss, torch.tensor(-1.0004))
    # inside the band the gradient of -A*s per token is -s/|y| (token-mean over 2 tokens of one sequence)
    logp2 = torch.tensor([[0.0001, -0.0001]], requires_grad=True)
    policy_loss(
        logp2, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4, ratio_type="sequence"
    ).loss.backward()
    close(logp2.grad, torch.full((1, 2), -0.5))


def test_value_loss_hand_example():
    # V 1.0, V_old .5, R 2: unclipped (1-2)^2 = 1; clipped V .7: (.7-2)^2 = 1.69 -> .5 * 1.69
    loss, frac = value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    )
    close(loss, torch.tensor(0.845))
    close(frac, torch.tensor(1.0))


# ---------------- KL, entropy, logprobs ----------------


def test_kl_estimators_hand_example():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(.25/.5) = -log 2
    close(kl_estimate(logp, ref, "k1"), torch.tensor([math.log(2)]))
    close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * math.log(2) ** 2]))
    close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 + math.log(2)]))
    close(kl_estimate(logp, ref, "low_var_kl"), kl_estimate(logp, ref, "k3"))
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=2, max_size=2))
def test_k3_non_negative(pair):
    assert float(kl_estimate(torch.tensor([pair[0]]), torch.tensor([pair[1]]), "k3")) >= 0


def test_k3_estimates_true_kl():
    # Samples from p; the mean of k3 converges to KL(p || q).
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = kl_estimate(p.log()[x], q.log()[x], "k3").mean()
    true = (p * (p / q).log()).sum()
    assert abs(float(est - true)) < 0.01


def test_entropy_and_logprobs_chunked_equal_direct():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=gen) * 3).requires_grad_(True)
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    direct_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    chunked_ent = entropy(logits, chunk=4)
    close(chunked_ent, direct_ent)
    (g1,) = torch.autograd.grad(direct_ent.sum(), logits)
    (g2,) = torch.autograd.grad(chunked_ent.sum(), logits)
    close(g1, g2)
    direct_lp = (logits / 0.7).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    close(token_logprobs(logits, targets, temperature=0.7, chunk=5), direct_lp)
    close(entropy(torch.zeros(2, 64)), torch.full((2,), math.log(64)))  # uniform: log V


@pytest.mark.parametrize("temperature", [1.0, 0.7, torch.tensor(1.3)])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
@pytest.mark.parametrize("keep_probs", [True, False])
def test_linear_head_closed_form_backward_equals_autograd(temperature, entropy_coef, keep_probs, monkeypatch):
    """head_logprobs on a plain linear head (closed-form backward, chunked) against autograd
    through full logits: same log-probs and entropies, same gradients for hidden rows and the
    head's weight, with and without the entropy in the loss, from kept or recomputed softmaxes."""
    import miles.algo.logprobs as logprobs

    if not keep_probs:
        monkeypatch.setattr(logprobs, "SAVED_PROBS_BYTES", 0)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=gen))
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    weights = torch.randn(37, generator=gen)  # a per-token advantage

    logp, ent = head_logprobs(head, hidden, targets, temperature, chunk=8)
    got = torch.autograd.grad((logp * weights).sum() + entropy_coef * ent.sum(), (hidden, head.weight))
    logits = head(hidden)
    want_logp = (logits / temperature).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    want_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    want = torch.autograd.grad(
        (want_logp * weights).sum() + entropy_coef * want_ent.sum(), (hidden, head.weight)
    )
    close(logp, want_logp)
    close(ent, want_ent)
    for g, w in zip(got, want):
        close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 0.6, 1.3, 1.0])
def test_trainer_log_probs_divide_by_temperature_as_the_engine_samples(temperature):
    """Bitwise the engine's reported log-probs (true on-policy rests on it): the trainer divides
    by the temperature as the sampler does, by a tensor, not a Python number (which CUDA turns
    into a multiply by the reciprocal)."""
    gen = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(9, 300, generator=gen) * 4, torch.randint(0, 300, (9,), generator=gen)
    scaled, _ = scale_by_temperature(logits, torch.full((9,), temperature))
    engine = scaled.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.equal(token_logprobs(logits, targets, temperature=temperature), engine)
    assert torch.equal(tempered(logits, temperature), scaled)


# ---------------- importance sampling (TIS / MIS) ----------------


def test_tis_identity_when_train_equals_rollout():
    logp = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            w = importance_weights(logp, logp.clone(), mask, level=level, mode=mode, threshold=0.9)
            close(w.weights, mask.float())
            assert w.clipfrac == 0 and w.mean == 1


def test_tis_hand_example():
    rollout = torch.zeros(1, 4)
    train = torch.tensor([[math.log(3.0), math.log(1.2), math.log(1.05), math.log(0.4)]])
    mask = torch.ones(1, 4)
    # truncate at C=2: [2, 1.2, 1.05, .4]; clip-low .5: .4 -> .5
    close(
        importance_weights(train, rollout, mask, clip_high=2.0).weights, torch.tensor([[2.0, 1.2, 1.05, 0.4]])
    )
    close(
        importance_weights(train, rollout, mask, clip_high=2.0, clip_low=0.5).weights,
        torch.tensor([[2.0, 1.2, 1.05, 0.5]]),
    )
    # mask (MIS / icepop) with band [.5, 2]: 3 and .4 zeroed
    w = importance_weights(train, rollout, mask, mode="mask", clip_low=0.5, clip_high=2.0)
    close(w.weights, torch.tensor([[0.0, 1.2, 1.05, 0.0]]))
    close(w.clipfrac, torch.tensor(0.5))
    # threshold .9: trust band [.9, 1.111]: only 1.05 survives
    close(
        importance_weights(train, rollout, mask, threshold=0.9).weights, torch.tensor([[0.0, 0.0, 1.05, 0.0]])
    )
    # sequence level: exp(sum log) = 3 * 1.2 * 1.05 * .4 = 1.512 on every token
    close(importance_weights(train, rollout, mask, level="sequence").weights, torch.full((1, 4), 1.512))
    # geometric: 1.512 ** (1/4)
    close(
        importance_weights(train, rollout, mask, level="geometric").weights, torch.full((1, 4), 1.512**0.25)
    )


def test_tis_weights_are_detached_and_scale_the_loss():
    train = torch.tensor([[0.3, -0.2]], requires_grad=True)
    w = importance_weights(train, torch.zeros(1, 2), torch.ones(1, 2))
    assert not w.weights.requires_grad
    logp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.ones(1, 2)
    plain = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2)).loss
    weighted = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), token_weights=w.weights).loss
    # ratio 1: plain = -1; weighted = -(e^.3 + e^-.2)/2
    close(plain, torch.tensor(-1.0))
    close(weighted, torch.tensor(-(math.exp(0.3) + math.exp(-0.2)) / 2))


def test_invalid_threshold_is_a_clear_error():
    with pytest.raises(ValueError, match="--tis-threshold"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), threshold=1.5)


def test_mismatch_metrics_hand_example():
    train = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.1, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(train, rollout, mask)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.05)  # (|.1| + 0)/2
    assert m["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.1)
    assert m["kl_rollout_train_k1"] == pytest.approx(-0.05)  # mean(rollout - train) = (-.1 + 0)/2
    assert m["kl_rollout_train_k3"] == pytest.approx((math.exp(0.1) - 1 - 0.1) / 2)


# ---------------- dynamic sampling ----------------


def test_dynamic_sampling_drops_all_equal_groups():
    def group(*rs):
        return [SimpleNamespace(reward=r) for r in rs]

    groups = [group(1, 1, 1), group(0, 1, 0), group(0, 0, 0), group({"score": 1.0}, {"score": 0.5})]
    kept, dropped = apply_filter(groups, nonconstant_reward)
    assert kept == [groups[1], groups[3]] and dropped == 2


def test_masked_var_matches_torch():
    x = torch.randn(10)
    close(masked_var(x, torch.ones(10)), x.var())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3))
def test_routing_mismatch_counts_changed_decisions(seed, k):
    """The recorded experts are the trainer's own top-k (shuffled: order does not matter) with
    some (token, layer) decisions changed; the metric finds exactly those, over counted positions
    only (mask, and -1 = not recorded)."""
    g = torch.Generator().manual_seed(seed)
    B, T, L, E = 3, 7, 2, 6
    logits = [torch.randn(B, T, E, generator=g) for _ in range(L)]
    own = torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=2)
    recorded = own.gather(-1, torch.argsort(torch.rand(B, T, L, k, generator=g), dim=-1))
    changed = torch.rand(B, T, L, generator=g) < 0.3
    unused = torch.stack([torch.tensor([e for e in range(E) if e not in own[b, t, layer]][0])
                          for b in range(B) for t in range(T) for layer in range(L)]).view(B, T, L)  # fmt: skip
    recorded[..., 0] = torch.where(changed, unused, recorded[..., 0])
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    recorded[0, 0] = -1  # not recorded: never counted
    valid = mask.bool().clone()
    valid[0, 0] = False
    got = routing_mismatch(torch.stack(logits, dim=2), recorded, mask)
    if not valid.any():
        assert got == {}
        return
    assert got["routing_mismatch_frac"] == pytest.approx(float(changed[valid].float().mean()))
    assert got["routing_mismatch_token_frac"] == pytest.approx(float(changed.any(-1)[valid].float().mean()))


# ---------------- CISPO and OPSM ----------------


def test_cispo_hand_example():
    # two tokens, eps_high 0.2: r = e^0.1 = 1.10517 (kept), r = e^0.5 = 1.64872 (capped at 1.2)
    # per token -w * A * logp: token 1: -1.10517 * 2 * (-1.0) = 2.21034; token 2: -1.2 * (-1) * (-2.0) = -2.4
    # token-mean over 2 tokens: (2.21034 - 2.4) / 2 = -0.09483
    from miles.algo.losses import cispo_loss

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.5]])
    adv = torch.tensor([[2.0, -1.0]])
    out = cispo_loss(logp, old, adv, torch.ones(1, 2), eps_clip_high=0.2)
    close(out.loss, torch.tensor(-0.094829), atol=1e-5, rtol=0)
    assert float(out.clipfrac) == 0.5
    out.loss.backward()
    # d/dlogp = -w * A / 2: the weight carries no gradient, and the capped token keeps its own
    close(logp.grad, torch.tensor([[-1.10517 * 2 / 2, 1.2 / 2]]), atol=1e-5, rtol=0)


def test_opsm_hand_example():
    # behaviour - current per token; mean over each response's real tokens:
    # seq 0: (0.3 + 0.1) / 2 = 0.2 > delta, negative advantage -> dropped
    # seq 1: same drift, positive advantage -> kept
    # seq 2: (0.05 + 0.0 + pad) / 2 = 0.025 < delta, negative advantage -> kept
    from miles.algo.losses import opsm_keep

    current = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, 9.0]])
    behaviour = torch.tensor([[-0.7, -0.9, 0.0], [-0.7, -0.9, 0.0], [-0.95, -1.0, -50.0]])
    adv = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])
    keep = opsm_keep(current, behaviour, adv, mask, delta=0.1)
    close(keep[:, :2], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    assert opsm_keep(current, behaviour, adv, mask, delta=0.25).min() == 1.0  # a higher threshold keeps all
