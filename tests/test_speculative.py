"""Speculative decoding: the acceptance rule reproduces p exactly, the engine's tokens follow the
policy (identical at temperature 0, the same distribution at temperature 1, even with a bad draft),
log-probs and R3 routing are the policy's, and the draft learns online."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.models.eagle import EagleHead
from miles.rollout import Engine, Request, SamplingParams
from miles.rollout.drafts import EagleDraft, ModelDraft, NgramDraft, auto_draft
from miles.rollout.sampling import draw
from miles.rollout.speculative import (
    Speculator,
    accept,
    best_lookahead,
    expected_tokens_per_pass,
    sampling_probs,
    tokens_per_pass_by_position,
    verify_probs,
)
from miles.train.draft_trainer import EagleTrainer
from tests.conftest import response_logprobs


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


@pytest.mark.parametrize("draft", ["close", "bad", "disjoint"])
def test_acceptance_rule_samples_exactly_from_p(draft):
    gen = torch.Generator().manual_seed(0)
    V, n = 6, 25_000
    p = torch.tensor([[0.05, 0.4, 0.25, 0.1, 0.15, 0.05], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]])
    q = {
        "close": p[:1] * 0.9 + 0.1 / V,
        "bad": torch.tensor([[0.7, 0.02, 0.02, 0.02, 0.02, 0.22]]),
        "disjoint": torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]),  # never proposes most tokens
    }[draft]
    proposals = torch.multinomial(q[0], n, replacement=True, generator=gen).tolist()
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    decided = accept([[x] for x in proposals], q.expand(n, 1, V), p.expand(n, 2, V), generators)
    first = torch.bincount(
        torch.tensor([x if accepted else following for x, (accepted, following) in zip(proposals, decided)]),
        minlength=V,
    )
    assert _tv(first / n, p[0]) <= 0.01


def test_verify_probs_are_the_sampling_distribution_and_the_recorded_log_probs():
    """One softmax for both where it can: against sampling_probs and the log-softmax of the scaled
    logits, for sampled rows, and with a greedy or top-k row in the batch (the separate path)."""
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k in (([0.7, 1.0, 1.3], [0, 0, 0]), ([0.7, 0.0, 1.3], [0, 0, 5])):
        temperature, top_k, top_p = torch.tensor(temperature), torch.tensor(top_k), torch.ones(3)
        p, logp = verify_probs(logits, temperature, top_k, top_p)
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
        torch.testing.assert_close(logp, scaled.log_softmax(-1))
        torch.testing.assert_close(p, sampling_probs(logits, temperature, top_k, top_p), rtol=1e-5, atol=1e-7)


def test_draw_samples_each_row_from_its_own_distribution():
    """Inverse-CDF draws: 40k per row within total variation 0.01 of the row's distribution, and
    never a token of probability 0 (the zeros at both ends and inside included)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 50, generator=gen)
    probs[:, :3] = probs[:, -4:] = probs[:, 20:30] = 0
    probs[2] = 0
    probs[2, 7] = 1.0  # a one-hot row
    probs = probs / probs.sum(-1, keepdim=True)
    generators = [torch.Generator().manual_seed(s) for s in range(3)]
    n = 40_000
    drawn = torch.stack([draw(probs, generators) for _ in range(n)])  # (n, 3)
    for b in range(3):
        counts = torch.bincount(drawn[:, b], minlength=50) / n
        assert _tv(counts, probs[b]) <= 0.02  # about 0.012 expected at this n; a shifted index: far more
        assert counts[probs[b] == 0].sum() == 0


def test_expected_tokens_and_best_lookahead():
    assert expected_tokens_per_pass(0.0, 5) == 1.0 and expected_tokens_per_pass(1.0, 5) == 6.0
    assert abs(expected_tokens_per_pass(0.8, 4) - (1 - 0.8**5) / 0.2) < 1e-12
    assert best_lookahead(0.9, draft_seconds_per_token=0.01, verify_seconds=1.0) == 8  # drafting is free
    assert best_lookahead(0.1, draft_seconds_per_token=0.5, verify_seconds=1.0) == 1


@pytest.fixture(scope="module")
def tiny():
    from miles.models import registry

    policy, tokenizer = registry.load("tiny")
    return policy.eval(), tokenizer


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"{a} + {b} =") for a, b in zip(range(10, 10 + n), range(40, 40 + n))]


def _engine(policy, tokenizer, draft=None, k=4, slots=16):
    spec = None
    if isinstance(draft, EagleHead):
        spec = Speculator(EagleDraft(copy.deepcopy(draft), record_features=True), k, max_batch=slots)
    elif draft == "auto":
        spec = Speculator(ModelDraft(auto_draft(policy, 1), slots, 64), k, max_batch=slots)
    elif draft == "ngram":
        spec = Speculator(NgramDraft(), k, max_batch=slots)
    elif draft is not None:
        spec = Speculator(ModelDraft(draft, slots, 64), k, max_batch=slots)
    return Engine(
        copy.deepcopy(policy), tokenizer, max_batch_size=slots, max_seq_len=64, seed=0, speculator=spec
    )


@pytest.fixture(scope="module")
def eagle(tiny):
    """An EAGLE head for the tiny policy before and after online training on 48 of its samples
    (temperature 1), with those samples."""
    policy, tokenizer = tiny
    head = EagleHead.for_policy(policy, draft_vocab=0)
    samples = _engine(policy, tokenizer, head, slots=48).generate(
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True))
        for p in _prompts(tokenizer, 12) * 4
    )
    trainer = EagleTrainer(head, lambda: policy, lr=3e-3, micro_batch=4, replay_windows=0)
    for _ in range(4):
        trainer.train(samples)
    return head, trainer.served(), samples


@pytest.mark.parametrize("draft", ["auto", "ngram", "eagle"])
def test_greedy_tokens_logprobs_and_routing_equal_plain_decoding(tiny, eagle, draft):
    policy, tokenizer = tiny
    draft = eagle[1] if draft == "eagle" else draft
    requests = lambda: [  # noqa: E731
        Request(p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
        for p in _prompts(tokenizer, 12)
    ]
    plain = _engine(policy, tokenizer).generate(requests())
    engine = _engine(policy, tokenizer, draft)
    fast = engine.generate(requests())
    assert [s.tokens for s in fast] == [s.tokens for s in plain]
    oracle = response_logprobs(policy, fast)
    diff = max(abs(a - b) for s, o in zip(fast, oracle) for a, b in zip(s.rollout_log_probs, o))
    assert diff <= 1e-5
    mismatched = sum(
        int((a.rollout_routed_experts != b.rollout_routed_experts).sum()) for a, b in zip(fast, plain)
    )
    total = sum(a.rollout_routed_experts.size for a in fast)
    assert mismatched <= 0.001 * total  # the policy's own routing, for accepted tokens only
    stats = engine.speculator.stats
    assert stats.passes > 0 and stats.accepted > 0 and stats.emitted > stats.rows  # proposals were accepted
    # every token but each request's first comes from a decode step, speculative ones included
    times = engine.take_times()
    assert times.decode_tokens == sum(s.response_length - 1 for s in fast) and times.decode_seconds > 0


@pytest.mark.parametrize("kind, k", [("auto", 1), ("eagle", 2)])
def test_temperature_one_follows_the_policy_even_with_a_bad_draft(tiny, kind, k):
    """50k sampled tokens (25k requests x 2) through a random-weight draft (eagle: two chained
    proposals a pass): per-position distributions within total variation 0.01 of the policy's
    exact ones."""
    policy, tokenizer = tiny
    bad = auto_draft(policy, 1) if kind == "auto" else EagleHead.for_policy(policy, draft_vocab=40, seed=1)
    with torch.no_grad():
        for p in bad.parameters():
            p.normal_(0, 0.5)
    prompt = _prompts(tokenizer, 1)[0]
    n, slots = 25_000, 256
    engine = _engine(policy, tokenizer, bad, k=k, slots=slots)
    samples = engine.generate(
        Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)) for _ in range(n)
    )
    V = policy.config.vocab_size
    first = torch.bincount(torch.tensor([s.tokens[len(prompt)] for s in samples]), minlength=V) / n
    second = torch.bincount(torch.tensor([s.tokens[len(prompt) + 1] for s in samples]), minlength=V) / n
    with torch.no_grad():
        p1 = policy(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        grid = torch.tensor([prompt + [x] for x in range(V)])
        p2 = (p1[:, None] * policy(grid).logits[:, -1].softmax(-1)).sum(0)  # the exact marginal
    assert _tv(first, p1) <= 0.01 and _tv(second, p2) <= 0.01
    assert (
        engine.speculator.stats.accepted < engine.speculator.stats.proposed
    )  # the bad draft was rejected often


def test_eagle_features_are_the_states_each_token_was_sampled_from(tiny, eagle):
    """Every response token's recorded feature gives, through lm_head, the log-prob the engine
    recorded for that token (fp16 storage: 1e-2); a sample of n tokens has n features."""
    policy, _ = tiny
    samples = eagle[2]
    assert all(s.draft_features.shape == (s.response_length, policy.config.hidden_size) for s in samples)
    with torch.no_grad():
        for s in samples[:8]:
            logp = policy.lm_head(torch.from_numpy(s.draft_features).float()).log_softmax(-1)
            got = logp[torch.arange(s.response_length), torch.tensor(s.response_tokens)]
            assert torch.allclose(got, torch.tensor(s.rollout_log_probs), atol=1e-2)


def test_online_training_raises_the_eagle_drafts_acceptance(tiny, eagle):
    """Expected first-proposal acceptance (EagleTrainer.acceptance, checked against the engine in
    the next test) on the engine's own samples: the trained head well above the untrained one;
    the head reads the policy's lm_head, not a copy (its state is its own block)."""
    policy, _ = tiny
    untrained, trained, samples = eagle
    before = EagleTrainer(untrained, lambda: policy).acceptance(samples, 1.0, positions=1)[0]
    after = EagleTrainer(trained, lambda: policy).acceptance(samples, 1.0, positions=1)[0]
    assert after > before + 0.15, (before, after)
    assert not any("embed" in k or "lm_head" in k for k in trained.state_dict())


def test_expected_acceptance_is_what_the_engine_measures(tiny, eagle):
    """Exact speculative sampling accepts a proposal with probability sum_x min(p, q): the
    head's expected acceptance at each draft position, computed on the engine's own samples,
    within sampling noise of the acceptance the engine counted while making them (k = 2,
    temperature 1 and top-p 0.9 for both distributions, thousands of proposals)."""
    policy, tokenizer = tiny
    engine = _engine(policy, tokenizer, eagle[1], k=2, slots=64)
    samples = engine.generate(
        Request(p, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, ignore_eos=True))
        for p in _prompts(tokenizer, 12) * 16
    )
    stats = engine.speculator.stats
    measured = [a / o for a, o in zip(stats.at_position, stats.offered)]
    expected = EagleTrainer(eagle[1], lambda: policy).acceptance(samples, 1.0, top_p=0.9, positions=2)
    assert stats.offered[1] > 1000
    assert all(abs(m - e) < 0.03 for m, e in zip(measured, expected)), (measured, expected)


def test_a_run_with_an_online_draft_logs_acceptance_and_the_doctor_reads_it(tmp_path):
    """`miles train --draft-model eagle --online-sft-interval 1`: every step logs the spec_* metrics
    (tokens per pass = 1 + accepted length), the head's loss falls as it trains on the features
    the engine recorded, and `miles doctor` names the young head's low acceptance with remedies
    that load."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.doctor.checks import diagnose
    from miles.doctor.run import load_run
    from miles.run import train
    from tests.conftest import small_run_args

    out = tmp_path / "spec"
    flags = [
        "--draft-model",
        "eagle",
        "--online-sft-interval",
        "1",
        "--spec-max-batch-size",
        "64",
        "--no-spec-adaptive",
        "--eval-size",
        "0",
    ]
    train(load_config(small_run_args(out, 4) + flags))
    steps = [r for r in read_metrics(out) if "rollout" in r and r["rollout"] >= 0]
    assert all(abs(r["spec_tokens_per_pass"] - 1 - r["spec_accepted_len_mean"]) < 1e-9 for r in steps)
    losses = [r["draft_sft_loss"] for r in steps]
    assert losses[-1] < losses[0]
    findings = {f.check: f for f in diagnose(load_run(out))}
    assert "spec_low_acceptance" in findings
    offered = [r.flags for r in findings["spec_low_acceptance"].remedies]
    assert ["--draft-lr", "0.003"] in offered and ["--spec-lookahead", "3"] in offered
    for flags in offered:
        load_config(["--config", str(out / "config.yaml"), *flags])


def test_doctor_names_drift_and_a_draft_too_slow_for_its_acceptance(tmp_path):
    """The frozen draft of docs/speculative.md, in numbers: acceptance 0.46 falling to 0.35, and a
    draft costing as much as verification for 1.4 tokens per pass."""
    import json

    import yaml

    from miles.config import load_config
    from miles.doctor.checks import diagnose
    from miles.doctor.run import load_run

    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"speculative": {"draft_model": "auto", "spec_lookahead": 5}})
    )
    rates = [0.46 - 0.11 * i / 19 for i in range(20)]
    rows = [
        {
            "rollout": i,
            "reward_mean": 0.5,
            "spec_accept_rate": a,
            "spec_tokens_per_pass": 1.4,
            "spec_draft_seconds": 0.1,
            "spec_verify_seconds": 0.1,
        }
        for i, a in enumerate(rates)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    findings = {f.check: f for f in diagnose(load_run(tmp_path))}
    assert {"spec_drift", "spec_slow", "spec_low_acceptance"} <= set(findings)
    assert ["--online-sft-interval", "5"] in [r.flags for r in findings["spec_drift"].remedies]
    slow = [r.flags for r in findings["spec_slow"].remedies]
    assert ["--draft-model", "ngram"] in slow and [
        "--draft-model",
        "eagle",
        "--online-sft-interval",
        "5",
    ] in slow
    for flags in slow:  # each remedy loads on top of the run's own config
        load_config(["--config", str(tmp_path / "config.yaml"), *flags])
    rows = [dict(r, spec_accept_rate=0.46, spec_draft_seconds=0.01) for r in rows]  # steady, cheap draft
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not {"spec_drift", "spec_slow"} & {f.check for f in diagnose(load_run(tmp_path))}


def test_adaptive_speculation_takes_the_fastest_lookahead_per_batch_size_and_reexplores():
    """The rate of a lookahead is the expected tokens per row of a pass (from the acceptance
    counted at each position) over the seconds its passes took at that batch size: checked
    against the hand-computed rate, and the choice against the fastest by that rate."""
    spec = Speculator(NgramDraft(), 4, max_batch=16, adaptive=True, explore=4, warmup=2, decay=1.0)
    assert spec.choose(17) == 0  # above the cap: plain
    seconds = {0: 1.0, 1: 1.2, 2: 1.4, 3: 2.0, 4: 2.6}  # a pass's time at batch 8, by lookahead
    first = []
    for _ in range(10):
        first.append(spec.choose(8))
        spec.record(8, first[-1], seconds[first[-1]])
    assert first == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]  # each lookahead timed `warmup` times, plain last
    for _ in range(100):  # acceptance 0.5 at position 1, 0.8 after: rows of 0..4 accepted tokens
        for accepted in (0, 0, 0, 0, 0, 1, 2, 3, 4, 4):
            spec.observe(4, accepted)
    assert spec.acceptance(4) == pytest.approx([0.5, 0.8, 0.75, 2 / 3])  # from the counts above
    expected = {k: (tokens_per_pass_by_position([0.5, 0.8, 0.75, 2 / 3][:k]) if k else 1.0) / seconds[k]
                for k in seconds}  # fmt: skip
    assert all(spec.rate(8, k) == pytest.approx(expected[k]) for k in seconds)
    best = max(expected, key=expected.get)
    assert best == 2  # 1 + 0.5 + 0.4 = 1.9 tokens in 1.4 s
    picks = [spec.choose(8) for _ in range(8)]
    assert picks.count(best) == 6  # the others re-timed every 4th step, one after another
    assert len({k for k in picks if k != best}) == 2
    for _ in range(40):
        spec.record(8, 2, 3.0)  # lookahead 2 turns slow
    assert spec.choose(8) != 2
    assert spec.choose(5) == 4  # another batch size is timed on its own
    assert Speculator(NgramDraft(), 4, max_batch=16).choose(8) == 4  # not adaptive: always k
    # a position not checked yet is taken to accept as the one before it
    fresh = Speculator(NgramDraft(), 4, adaptive=True)
    fresh.observe(4, 1)
    assert fresh.acceptance(4) == [1.0, 0.0, 0.0, 0.0]


def test_miles_draft_trains_a_head_that_a_run_starts_from(tmp_path, capsys):
    """`miles draft` on the default job's policy and prompts: the saved head's held-out
    acceptance well above the untrained one's; --eagle-head gives the run's draft exactly the
    saved weights; a missing file, a foreign file, a head for another policy and --eagle-head
    without --draft-model eagle are clear errors."""
    import json
    import re

    from miles.cli import main
    from miles.config import load_config
    from miles.errors import ConfigError
    from miles.models import registry
    from miles.models.eagle import load_head
    from miles.rollout.drafts import load_draft
    from miles.rollout.speculative import tokens_per_pass_by_position
    from tests.conftest import random_model, small_run_args

    head_file = tmp_path / "head.pt"
    run = small_run_args(tmp_path / "run", 1)
    assert main(["draft", "--out", str(head_file), "--draft-prompts", "32", "--draft-epochs", "3", *run]) == 0
    report = json.loads(re.search(r"^\{.*?^\}", capsys.readouterr().out, re.S | re.M).group(0))
    assert report["held_out_acceptance"] > report["held_out_acceptance_before"] + 0.1, report
    by_position = report["held_out_acceptance_by_position"]
    assert by_position[0] == pytest.approx(report["held_out_acceptance"], abs=1e-4)
    assert report["tokens_per_pass"] == pytest.approx(tokens_per_pass_by_position(by_position), abs=2e-3)

    cfg = load_config([*run, "--draft-model", "eagle", "--eagle-head", str(head_file)])
    policy, _ = registry.load(cfg.model.model)
    draft = load_draft(cfg.speculative, policy, "cpu")
    saved = torch.load(head_file, weights_only=True)["state"]
    assert all(torch.equal(v, saved[k]) for k, v in draft.state_dict().items())

    with pytest.raises(ConfigError, match="no such file; write one with `miles draft"):
        load_head(tmp_path / "missing.pt", policy)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(ConfigError, match="not a head written by `miles draft`"):
        load_head(tmp_path / "foreign.pt", policy)
    other = random_model("llama", vocab_size=policy.config.vocab_size + 8)
    with pytest.raises(ConfigError, match="this policy has hidden"):
        load_head(head_file, other)
    with pytest.raises(ConfigError, match="--eagle-head starts --draft-model eagle"):
        load_config([*run, "--draft-model", "auto", "--eagle-head", str(head_file)])
