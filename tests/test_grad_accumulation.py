"""Gradient accumulation is exact: any micro-batch size, any rank count, the global batch's gradient.

The oracle is one forward/backward of the whole global batch through `aggregate` (no
accumulation at all); the logged loss is checked against the same loss written out by hand.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles.algo.masked import AGG_MODES, aggregate
from miles.config import make_config
from miles.data.sample import Sample
from miles.runtime.ray_train import split_evenly
from miles.train.batch import forward_logprobs, pack_samples
from miles.train.micro_batches import balance_over_ranks, rank_shares
from miles.train.policy_trainer import PolicyTrainer
from tests.conftest import random_model

N_SAMPLES = 48  # one global batch; 7 does not divide it (a ragged last micro-batch)
MAX_RESPONSE = 12


def make_samples(seed: int = 0) -> tuple[list[Sample], list[torch.Tensor]]:
    """Samples of very different lengths (so per-micro-batch normalisation would be visibly wrong),
    some with masked-out tokens, and random per-token advantages, 0 on some samples."""
    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(N_SAMPLES):
        prompt = [rng.randrange(1, 97) for _ in range(rng.randint(2, 6))]
        n = 1 + (i * 5) % MAX_RESPONSE if i < N_SAMPLES // 2 else 1 + i % 3  # long first half, short second
        response = [rng.randrange(1, 97) for _ in range(n)]
        s = Sample(tokens=prompt + response, response_length=n)
        if i % 5 == 0 and n > 2:
            s.loss_mask = [1] * (n - 1) + [0]  # e.g. a tool output the policy did not write
        samples.append(s)
        advantages.append(torch.tensor([rng.uniform(-2, 2) for _ in range(n)]))
        if 12 <= i < 16 or i >= 30:  # groups whose rewards were all equal: not run, still counted
            advantages[-1] = torch.zeros(n)
    return samples, advantages


def settings(agg: str, micro: int, **extra) -> dict:
    """One global batch of N_SAMPLES, no clipping; lr ~0 unless given, so p.grad is the step's gradient."""
    values = dict(
        rollout_batch_size=N_SAMPLES // 4, n_samples_per_prompt=4, micro_batch_size=micro,
        loss_agg_mode=agg, lr=1e-30, clip_grad=0.0, rollout_max_response_len=MAX_RESPONSE,
        share_prompts=False, eval_size=0,
    )  # fmt: skip
    return {**values, **extra}


def config(agg: str, micro: int, **extra):
    return make_config(settings(agg, micro, **extra))


def one_batch_gradient(model, samples, advantages, agg: str) -> dict[str, torch.Tensor]:
    """The oracle: the global batch's PPO loss at ratio 1 in one forward, no accumulation."""
    model.zero_grad(set_to_none=True)
    batch = pack_samples(samples)
    logp = forward_logprobs(model, batch).logprobs
    adv = torch.zeros_like(logp)
    for b, s in enumerate(samples):
        adv[b, s.prompt_length - 1 : len(s.tokens) - 1] = advantages[b]
    ratio = torch.exp(logp - logp.detach())
    aggregate(-adv * ratio, batch.response_mask, agg, MAX_RESPONSE).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def hand_loss(samples, advantages, agg: str) -> float:
    """The logged pg_loss at ratio 1, from the advantages alone."""
    per_seq, total, tokens = [], 0.0, 0
    for s, a in zip(samples, advantages):
        mask = s.loss_mask or [1] * s.response_length
        seq_sum = -sum(float(x) for x, m in zip(a, mask) if m)
        total, tokens = total + seq_sum, tokens + sum(mask)
        per_seq.append(seq_sum / sum(mask) if agg == "seq-mean-token-mean" else seq_sum / MAX_RESPONSE)
    return total / tokens if agg == "token-mean" else sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_size_does_not_change_the_gradient(agg):
    samples, advantages = make_samples()
    want = one_batch_gradient(random_model("qwen3"), samples, advantages, agg)
    for micro in (1, 7, 64, 256):
        model = random_model("qwen3")
        metrics = PolicyTrainer(model, config(agg, micro)).train(samples, advantages)
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, want[name], atol=1e-5, rtol=1e-4), (micro, name)
        assert metrics["pg_loss"] == pytest.approx(hand_loss(samples, advantages, agg), abs=1e-5), micro
        assert metrics["loss"] == pytest.approx(metrics["pg_loss"], abs=1e-6)


TOKEN_BUDGETS = (17, 40, 1000)  # the longest sample alone (17 tokens packed), a few rows, everything at once


@pytest.mark.parametrize("agg", AGG_MODES)
def test_token_budget_micro_batches_do_not_change_the_gradient(agg):
    """--use-dynamic-batch-size: micro-batches cut by padded tokens, samples of very different
    lengths grouped by length, give the global batch's gradient and loss."""
    samples, advantages = make_samples()
    want = one_batch_gradient(random_model("qwen3"), samples, advantages, agg)
    for budget in TOKEN_BUDGETS:
        model = random_model("qwen3")
        trainer = PolicyTrainer(model, dynamic_config(agg, budget))
        parts = trainer.micro_batches(range(N_SAMPLES), samples)
        assert sorted(i for p in parts for i in p) == list(range(N_SAMPLES))
        assert all(len(p) * max(len(samples[i].tokens) - 1 for i in p) <= budget for p in parts)
        metrics = trainer.train(samples, advantages)
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, want[name], atol=1e-5, rtol=1e-4), (budget, name)
        assert metrics["pg_loss"] == pytest.approx(hand_loss(samples, advantages, agg), abs=1e-5), budget


def dynamic_config(agg: str, budget: int):
    return config(agg, 256, use_dynamic_batch_size=True, max_tokens_per_gpu=budget)


def test_entropy_and_kl_terms_accumulate_exactly_too():
    samples, advantages = make_samples(seed=1)
    extra = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    grads, logged = [], []
    for micro in (1, 7, 48):
        model = random_model("qwen3_moe")
        ref = random_model("qwen3_moe", seed=5)  # a reference that differs, so the KL term is not 0
        metrics = PolicyTrainer(model, config("token-mean", micro, **extra), ref_model=ref).train(
            samples, advantages
        )
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        logged.append(metrics)
    for g, m in zip(grads[:-1], logged[:-1]):
        for name, want in grads[-1].items():
            assert torch.allclose(g[name], want, atol=1e-5, rtol=1e-4), name
        for key in ("loss", "pg_loss", "entropy", "kl_loss", "grad_norm"):
            assert m[key] == pytest.approx(logged[-1][key], rel=1e-5, abs=1e-6), key
    assert logged[-1]["loss"] == pytest.approx(
        logged[-1]["pg_loss"] - 0.01 * logged[-1]["entropy"] + 0.1 * logged[-1]["kl_loss"], abs=1e-6
    )


def with_zero_groups(samples, advantages):
    """Advantages of every other group of 4 set to 0 too, and one sample with signal made 0 at its
    trained tokens only (the rest masked out); returns them and the samples with signal left."""
    advantages = [torch.zeros_like(a) if (i // 4) % 2 else a for i, a in enumerate(advantages)]
    masked = next(i for i, s in enumerate(samples) if s.loss_mask is not None and bool(advantages[i].any()))
    advantages[masked] = advantages[masked] * (1 - torch.tensor(samples[masked].loss_mask))
    trained = [
        i
        for i, (s, a) in enumerate(zip(samples, advantages))
        if any(x != 0 and m for x, m in zip(a.tolist(), s.loss_mask or [1] * len(a)))
    ]
    assert masked not in trained and 0 < len(trained) < len(samples) // 2
    return advantages, trained


def tokens_seen(model) -> list[int]:
    """Rows the first projection runs on, per forward (pad-free: the real tokens)."""
    seen: list[int] = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    return seen


@pytest.mark.parametrize("agg", AGG_MODES)
def test_samples_without_advantage_are_not_run_and_the_gradient_is_the_same(agg):
    """The oracle is the whole batch's gradient and hand loss; the forward sees only the
    samples with a non-zero advantage at a trained token; --no-skip-zero-advantage runs all."""
    samples, advantages = make_samples()
    advantages, trained = with_zero_groups(samples, advantages)
    want = one_batch_gradient(random_model("qwen3"), samples, advantages, agg)
    for skip, micro in ((True, 7), (True, 256), (False, 256)):
        model = random_model("qwen3")
        seen = tokens_seen(model)
        metrics = PolicyTrainer(model, config(agg, micro, skip_zero_advantage=skip)).train(
            samples, advantages
        )
        run = trained if skip else range(N_SAMPLES)
        assert sum(seen) == sum(len(samples[i].tokens) - 1 for i in run), (skip, micro)
        assert metrics["zero_adv_frac"] == pytest.approx(1 - len(trained) / N_SAMPLES)
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, want[name], atol=1e-5, rtol=1e-4), (skip, micro, name)
        assert metrics["pg_loss"] == pytest.approx(hand_loss(samples, advantages, agg), abs=1e-5)


def test_a_step_without_any_advantage_still_steps_adamw():
    """All advantages 0 after a step with signal: AdamW's momentum and weight decay still move the
    weights, exactly as in the run that computes the zero gradient in full."""
    samples, advantages = make_samples()
    zero = [torch.zeros_like(a) for a in advantages]
    weights = []
    for skip in (True, False):
        model = random_model("qwen3_moe")
        seen = tokens_seen(model)
        trainer = PolicyTrainer(
            model, config("token-mean", 256, lr=1e-2, weight_decay=0.1, skip_zero_advantage=skip)
        )
        trainer.train(samples, advantages)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen.clear()
        trainer.train(samples, zero)
        assert sum(seen) == (
            min(len(s.tokens) for s in samples) - 1 if skip else sum(len(s.tokens) - 1 for s in samples)
        )
        assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, w in weights[0].items():  # ~1e-3 of a step: Adam scales the gradients' rounding up
        assert torch.allclose(w, weights[1][name], atol=1e-5, rtol=1e-5), name


def test_two_optimizer_steps_a_rollout_skip_the_same_samples_exactly():
    """--num-steps-per-rollout 2: the old log-probs come from a forward before the first update
    (of the trained samples only); both steps' updates equal the run that computes every sample."""
    samples, advantages = make_samples()
    advantages, _ = with_zero_groups(samples, advantages)
    weights = []
    for skip in (True, False):
        model = random_model("qwen3")
        cfg = config("token-mean", 7, lr=1e-3, num_steps_per_rollout=2, skip_zero_advantage=skip)
        PolicyTrainer(model, cfg).train(samples, advantages)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    base = random_model("qwen3").state_dict()
    for name, w in weights[0].items():
        # rounding only: AdamW turns a ~0 gradient element's noise into up to a step (1e-3 here)
        moved = float((weights[1][name] - base[name]).abs().max())
        assert moved > 0 and float((w - weights[1][name]).abs().max()) <= 1e-2 * moved, name


def test_other_loss_terms_keep_every_sample():
    """An entropy bonus reads samples whatever their advantage: none is left out."""
    samples, advantages = make_samples()
    advantages, _ = with_zero_groups(samples, advantages)
    model = random_model("qwen3")
    seen = tokens_seen(model)
    PolicyTrainer(model, config("token-mean", 256, entropy_coef=0.01)).train(samples, advantages)
    assert sum(seen) == sum(len(s.tokens) - 1 for s in samples)


def _rank(rank: int, port: int, out) -> None:
    """One of two gloo ranks: every aggregation mode and micro-batch size on this rank's half
    (long samples on rank 0, short on rank 1), with the production all-reduce helpers."""
    import os

    import torch.distributed as dist

    from miles.runtime.ray_train import all_reduce_gradients, all_sum

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    samples, advantages = make_samples()
    mine = split_evenly(list(range(N_SAMPLES)), 2)[rank]
    balanced = rank_shares([len(s.tokens) for s in samples], 2, N_SAMPLES, balanced=True)[rank]
    results = {}
    for agg in AGG_MODES:
        for micro in (1, 7, 64, 256):
            model = random_model("qwen3")
            trainer = PolicyTrainer(model, config(agg, micro), world=2)
            trainer.grad_sync = lambda finite, m=model: all_reduce_gradients(m, finite)
            trainer.all_sum = lambda values: all_sum(values, torch.device("cpu"))
            metrics = trainer.train([samples[i] for i in mine], [advantages[i] for i in mine])
            results[agg, micro] = (
                metrics["pg_loss"],
                {
                    n: p.grad.numpy().copy() for n, p in model.named_parameters()
                },  # by value, not shared memory
            )
        for budget in TOKEN_BUDGETS:  # token-balanced shares, token-budget micro-batches
            model = random_model("qwen3")
            trainer = PolicyTrainer(model, dynamic_config(agg, budget), world=2)
            trainer.grad_sync = lambda finite, m=model: all_reduce_gradients(m, finite)
            trainer.all_sum = lambda values: all_sum(values, torch.device("cpu"))
            metrics = trainer.train([samples[i] for i in balanced], [advantages[i] for i in balanced])
            results[agg, f"tokens {budget}"] = (
                metrics["pg_loss"],
                {n: p.grad.numpy().copy() for n, p in model.named_parameters()},
            )
    out.put((rank, results))
    dist.destroy_process_group()


def test_two_ranks_take_the_global_batch_step():
    """Two gloo ranks whose shards differ in token count, every mode and micro-batch size: each
    rank's gradient and logged loss are the one-process global batch's."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    samples, advantages = make_samples()
    for agg in AGG_MODES:
        want = one_batch_gradient(random_model("qwen3"), samples, advantages, agg)
        for micro in (1, 7, 64, 256, *(f"tokens {b}" for b in TOKEN_BUDGETS)):
            for rank in (0, 1):
                loss, grads = got[rank][agg, micro]
                assert loss == pytest.approx(hand_loss(samples, advantages, agg), abs=1e-5), (
                    agg,
                    micro,
                    rank,
                )
                for name, g in grads.items():
                    assert torch.allclose(torch.from_numpy(g), want[name], atol=1e-5, rtol=1e-4), (
                        agg,
                        micro,
                        rank,
                    )


def test_ranks_get_equal_counts_and_balanced_tokens():
    """Token balancing keeps every rank's sample count (the loss scale counts on it) and brings
    the token totals within one sample of each other, where contiguous halves differ ~3x here."""
    samples, _ = make_samples()
    lengths = [len(s.tokens) for s in samples]
    for world in (2, 3, 4):
        shares = balance_over_ranks(lengths, world)
        assert sorted(i for s in shares for i in s) == list(range(N_SAMPLES))
        assert {len(s) for s in shares} == {N_SAMPLES // world}
        totals = [sum(lengths[i] for i in s) for s in shares]
        assert max(totals) - min(totals) <= max(lengths)
    halves = [sum(lengths[i] for i in s) for s in split_evenly(list(range(N_SAMPLES)), 2)]
    assert max(halves) > 1.5 * min(halves)  # the data order alone would not balance them


def saved_bytes(model, samples) -> int:
    """Bytes autograd keeps for backward during one training forward of `samples`."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_logprobs(model, pack_samples(samples))
    return total


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_recomputed_activations_give_the_same_gradient_and_keep_less(arch):
    """--recompute-activations: the same gradient (each layer runs again in backward on the same
    input), and far fewer bytes held between forward and backward."""
    from miles.train.prepare import prepare_train_model

    samples, advantages = make_samples()
    grads, kept = [], []
    for recompute in (False, True):
        model = random_model(arch)
        cfg = config("token-mean", 16, recompute_activations=recompute)
        prepare_train_model(model, cfg)
        kept.append(saved_bytes(model, samples))
        PolicyTrainer(model, cfg).train(samples, advantages)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, atol=1e-6, rtol=1e-5), name
    assert kept[1] < kept[0] / 2, kept


def test_host_optimizer_steps_exactly_as_adamw():
    """--optimizer-cpu-offload's AdamW over host copies: the same weights as AdamW step for step
    (bitwise: the same update arithmetic on the same numbers), its moments off the model's
    tensors, and weights loaded into the model between steps (a resume) are the ones stepped."""
    from miles.train.host_optimizer import HostAdamW

    options = dict(lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01)
    plain, offloaded = random_model("qwen3"), random_model("qwen3")
    optimizers = [
        torch.optim.AdamW(plain.parameters(), **options),
        HostAdamW(offloaded.parameters(), **options),
    ]
    samples, advantages = make_samples()
    for step in range(3):
        if step == 2:  # a resume: new weights arrive in both models
            fresh = random_model("qwen3", seed=9).state_dict()
            plain.load_state_dict(fresh)
            offloaded.load_state_dict(fresh)
        for model, optimizer in zip((plain, offloaded), optimizers):
            optimizer.zero_grad()
            logp = forward_logprobs(model, pack_samples(samples[:8])).logprobs
            (logp.sum() * advantages[0][0]).backward()
            optimizer.step()
        for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
            assert torch.equal(a, b), (step, name)
    host_state = {id(t) for s in optimizers[1].state.values() for t in s.values()}
    assert not host_state & {id(p) for p in offloaded.parameters()}
