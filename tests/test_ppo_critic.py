"""PPO with a learned critic: the critic learns a known value, its accumulation is exact, and a
PPO run trains critic then policy and resumes with its critic."""

from __future__ import annotations

import pytest
import torch

from miles.config import load_config
from miles.data.sample import Sample
from miles.train.critic import Critic, explained_variance, value_model
from tests.conftest import DEFAULT_YAML, small_run_args


def _samples(tokenizer, n: int = 16, seed: int = 0) -> list[Sample]:
    """Prompts of two kinds; the reward is 1 for the first kind and 0 for the second, whatever the
    response: the true value of every response position is the prompt's reward."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tokenizer.encode("good question:" if i % 2 == 0 else "bad question?")
        response = torch.randint(
            40, 120, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen
        ).tolist()
        out.append(Sample(tokens=prompt + response, response_length=len(response), reward=float(i % 2 == 0)))
    return out


def _critic(micro: int = 64, **flags) -> tuple[Critic, object]:
    from miles.models import registry

    args = ["--config", str(DEFAULT_YAML), "--advantage-estimator", "ppo", "--micro-batch-size", str(micro)]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    cfg = load_config(args)
    policy, tokenizer = registry.load("tiny")
    return Critic(value_model(policy, None, 0), cfg), tokenizer


def test_explained_variance_by_hand():
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert explained_variance(returns, returns) == 1.0
    assert explained_variance(torch.full((4,), 0.5), returns) == 0.0  # the mean: explains nothing
    assert explained_variance(torch.tensor([0.5, 0.0, 0.5, 0.0]), returns) == pytest.approx(0.75)


def test_the_critic_learns_a_prompt_dependent_value():
    critic, tokenizer = _critic(critic_lr=1e-3)
    samples = _samples(tokenizer)
    _, returns, values = critic.advantages(samples)
    assert all(float(v.abs().max()) == 0.0 for v in values)  # a zero head: V = 0 at the start
    assert all(
        torch.equal(r, torch.full_like(r, s.reward)) for r, s in zip(returns, samples)
    )  # gamma = lambd = 1
    history = [
        critic.train(samples, returns, critic.values(samples))["explained_variance"] for _ in range(20)
    ]
    assert history[0] == pytest.approx(0.0, abs=1e-6)
    assert max(history[-5:]) > 0.9, history[-5:]
    held_out = _samples(tokenizer, seed=1)  # new responses to the same two kinds of prompt
    predicted = torch.stack([v.mean() for v in critic.values(held_out)])
    assert predicted[0::2].min() > 0.7 and predicted[1::2].max() < 0.3


def test_critic_gradient_accumulation_is_exact():
    whole, tokenizer = _critic(micro=64)
    split, _ = _critic(micro=3)  # 16 samples in micro-batches of 3, 3, 3, 3, 3, 1
    samples = _samples(tokenizer)
    _, returns, values = whole.advantages(samples)
    returns = [r + 0.1 * i for i, r in enumerate(returns)]  # a non-trivial target
    a, b = whole.train(samples, returns, values), split.train(samples, returns, values)
    assert b["value_loss"] == pytest.approx(a["value_loss"], rel=1e-5)
    assert b["critic_grad_norm"] == pytest.approx(a["critic_grad_norm"], rel=1e-4)
    for p, q in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_ppo_run_warms_the_critic_then_trains_both_and_resumes_with_its_critic(tmp_path):
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    flags = [
        "--advantage-estimator",
        "ppo",
        "--critic-warmup",
        "1",
        "--critic-lr",
        "1e-3",
        "--eval-size",
        "0",
    ]
    train(load_config(small_run_args(tmp_path / "ref", 3) + flags))
    ref = read_metrics(tmp_path / "ref")
    assert "pg_loss" not in ref[0] and "value_loss" in ref[0]  # rollout 0: the critic alone
    assert all("pg_loss" in r and "value_loss" in r for r in ref[1:])
    assert ref[0]["values_mean"] == 0.0 and ref[1]["values_mean"] != 0.0  # the critic moved
    save = tmp_path / "ckpt"
    train(load_config(small_run_args(tmp_path / "run", 2) + flags + ["--save", str(save)]))
    train(load_config(small_run_args(tmp_path / "run", 3) + flags + ["--load", str(save)]))
    resumed = read_metrics(tmp_path / "run")
    for key in ("value_loss", "explained_variance", "values_mean", "pg_loss", "grad_norm"):
        assert resumed[-1][key] == pytest.approx(ref[-1][key], rel=1e-4, abs=1e-6), key
