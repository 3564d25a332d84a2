"""Memory controls: token-budget micro-batches, auto-batch sizing, and what each refuses."""

from __future__ import annotations

import pytest

from miles.config import load_config, make_config
from miles.errors import ConfigError
from miles.train.auto_batch import MARGIN, AutoBatch
from miles.train.micro_batches import split_to_count, token_micro_batches
from tests.conftest import random_model, small_run_args


def test_auto_batch_finds_the_largest_budget_under_a_linear_memory_law():
    """A memory law peak = 3 GB + 2 MB x tokens, budget 5 GB: the chosen budget grows at most 2x
    a step from one sample, never measures a micro-batch over the budget, and settles where the
    law meets the budget less the margin (brute force over every token count)."""

    def law(tokens: int) -> int:
        return int(3e9 + 2e6 * tokens)

    budget = 5e9
    auto = AutoBatch(budget, floor_tokens=24)
    sizes = []
    for _ in range(20):
        tokens = auto.tokens
        assert law(tokens) <= budget
        sizes.append(tokens)
        auto.observe(tokens, law(tokens))
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))
    best = max(t for t in range(1, 10_000) if law(t) <= budget * (1 - MARGIN))
    assert best - 2 <= auto.tokens <= best


def test_auto_batch_stops_growing_where_larger_micro_batches_get_slower():
    """Time per token lowest near 2000 tokens (a cache-bound CPU), memory plenty: the budget
    settles near that size instead of at the memory limit."""

    def seconds(tokens: int) -> float:
        return 0.01 + tokens / 1e5 + (tokens / 2e4) ** 2

    auto = AutoBatch(1e12, floor_tokens=100)
    for _ in range(30):
        tokens = auto.tokens
        auto.observe(tokens, int(1e9 + 1e5 * tokens), seconds(tokens))
    assert 1000 <= auto.tokens <= 4000, auto.tokens


def test_auto_batch_shrinks_when_a_measurement_comes_in_over_the_line():
    auto = AutoBatch(4e9, floor_tokens=10)
    auto.observe(100, int(1e9))
    auto.observe(200, int(2e9))  # 10 MB a token: 360 tokens fit 3.6 GB
    assert auto.tokens == 360
    auto.observe(360, int(4.5e9))  # longer samples cost more than the line said: refit, smaller
    assert auto.tokens < 360


def test_memory_budget_below_the_weights_is_refused_naming_both():
    from miles.train.policy_trainer import PolicyTrainer

    cfg = make_config(dict(auto_batch=True, memory_budget_gb=1e-4, eval_size=0))
    with pytest.raises(ConfigError, match=r"--memory-budget-gb 0.0001 is below .* weights .* GB .* = .* GB"):
        PolicyTrainer(random_model("qwen3"), cfg)


def test_token_budget_smaller_than_the_longest_sample_is_refused(tmp_path):
    from miles.run import train

    args = small_run_args(tmp_path, 1) + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8"]
    with pytest.raises(
        ConfigError, match=r"--max-tokens-per-gpu 8 is smaller than the longest sample .* use at least"
    ):
        train(load_config(args))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-dynamic-batch-size"], "needs --max-tokens-per-gpu"),
        (["--max-tokens-per-gpu", "512"], "add it"),
        (["--auto-batch"], "go together"),
        (["--memory-budget-gb", "4"], "go together"),
        (["--optimizer-cpu-offload", "--data-parallel", "fsdp"], "use --data-parallel ddp"),
    ],
)
def test_memory_flags_without_their_companion_are_refused(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(small_run_args(tmp_path, 1) + flags)


def test_micro_batch_plans_keep_every_sample_and_the_budget():
    lengths = [5, 17, 3, 9, 9, 12, 1, 17, 4]
    for budget in (17, 20, 34, 100):
        parts = token_micro_batches(range(len(lengths)), lengths, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        assert all(len(p) * max(lengths[i] for i in p) <= budget for p in parts)
    parts = token_micro_batches(range(len(lengths)), lengths, 100)
    for count in (len(parts), 5, 9):  # FSDP: as many micro-batches as the busiest rank
        more = split_to_count(parts, count)
        assert len(more) == count and sorted(i for p in more for i in p) == list(range(len(lengths)))


def test_auto_batch_run_stays_under_its_budget(tmp_path):
    """A short run with --auto-batch: each step reports its micro-batch peak under the budget and
    the budget it chose, grown from one sample."""
    from miles.devices import step_peak_memory
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    budget = step_peak_memory()["peak_rss"] / 1e9 + 1.0  # this process now, plus 1 GB for training
    args = small_run_args(tmp_path, 2) + [
        "--auto-batch",
        "--memory-budget-gb",
        f"{budget:.2f}",
        "--eval-interval",
        "0",
    ]
    train(load_config(args))
    steps = [r for r in read_metrics(tmp_path) if r["rollout"] >= 0]
    assert all(0 < r["auto_batch_peak_gb"] < budget for r in steps)
    assert steps[-1]["auto_batch_tokens"] > 40  # grew past a single sample's few dozen tokens
