"""Misbehaving rewards and models: contained, printed once, and a run that cannot learn stops loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib

import pytest

from miles.config import load_config
from miles.data import Sample, Status
from miles.diagnostics.metrics_file import read_metrics
from miles.errors import MilesError
from miles.rewards import RewardRunner
from miles.run import train
from tests.conftest import ROOT, small_run_args


def miles_train(args: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m miles.cli train ARGS` in its own process, as a user runs it."""
    cmd = [sys.executable, "-m", "miles.cli", "train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# --- reward functions the tests point --custom-rm-path at (imported by the reward processes) ---


HANGS_ON_A_FIFTH = """
import time, zlib

def reward(sample):  # the right reward, but about one call in five never returns
    if zlib.crc32(sample.response.encode()) % 5 == 0:
        time.sleep(3600)
    return float(sample.response.strip() == str(sample.label).strip())
"""


def hanging_reward(tmp_path) -> str:
    """A light module (a killed worker's replacement re-imports it) as --custom-rm-path."""
    (tmp_path / "hang_reward.py").write_text(HANGS_ON_A_FIFTH)
    return f"{tmp_path / 'hang_reward.py'}:reward"


def test_a_hung_call_does_not_block_the_calls_after_it(tmp_path):
    runner = RewardRunner("exact", hanging_reward(tmp_path), False, 0.5, num_workers=2)
    try:
        responses = [str(i) for i in range(40)]
        hang = [zlib.crc32(r.encode()) % 5 == 0 for r in responses]
        assert 4 <= sum(hang) <= 14  # the fixture hangs on some, not all
        for _ in range(2):  # the second batch runs after the first one's hung workers were killed
            samples = [Sample(response=r, label="7") for r in responses]
            t0 = time.monotonic()
            failed = runner.score_groups([samples])
            assert failed == sum(hang)
            for s, h in zip(samples, hang):
                assert (s.status == Status.FAILED) == h
                assert s.reward == float(s.response == "7" and not h)
            # each hung call costs one timeout on one of 2 workers, no more
            assert time.monotonic() - t0 < 0.5 * sum(hang) / 2 + 5
        assert runner.workers.replaced == 2 * sum(hang)
    finally:
        runner.close()
    assert all(not w.process.is_alive() for w in runner.workers.workers)


def test_a_worker_killed_mid_call_runs_the_call_again(tmp_path):
    """A worker killed from outside (a fault, the OOM killer) costs no result: the call runs once
    more on a fresh worker. A call that kills its worker every time fails (`dies` below)."""
    from miles.rewards.workers import RewardWorkers

    workers = RewardWorkers("tests.reward_fixtures:dies_once", 2, 30.0)
    try:
        assert workers.map([(str(tmp_path / f"marker{i}"),) for i in range(3)]) == [1.0] * 3
    finally:
        workers.close()
    assert workers.replaced == 3


@pytest.mark.parametrize(
    "func, kind, shown",
    [
        ("always_raises", "ValueError", "cannot parse"),
        ("returns_none", "NonNumericReward", "non-numeric reward None"),
        ("returns_text", "NonNumericReward", "non-numeric reward 'correct'"),
        ("returns_nan", "NonFiniteReward", "non-finite reward nan"),
        ("exits", "SystemExit", "called sys.exit(3)"),
        ("dies", "WorkerDied", "exit code 7"),
    ],
)
def test_a_reward_that_fails_every_sample_stops_the_run_and_says_why(tmp_path, caplog, func, kind, shown):
    args = small_run_args(tmp_path / "run", 3) + ["--custom-rm-path", f"tests.reward_fixtures:{func}"]
    with pytest.raises(MilesError, match=f"every reward of rollout 0 failed \\(16/16\\).*{kind}"):
        train(load_config(args))
    printed = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(printed) == 1 and shown in printed[0]  # the first failure, once; the rest counted
    if kind == "ValueError":
        assert "Traceback" in printed[0] and "always_raises" in printed[0]


def test_nan_weights_stop_the_run_after_the_skipped_steps(tmp_path, monkeypatch, caplog):
    import torch

    import miles.runtime.assemble as assemble

    real = assemble.build_executor

    def poisoned(cfg, policy, *rest, **kwargs):
        with torch.no_grad():
            policy.model.norm.weight.fill_(float("nan"))
        return real(cfg, policy, *rest, **kwargs)

    monkeypatch.setattr(assemble, "build_executor", poisoned)
    args = small_run_args(tmp_path / "run", 6) + ["--max-consecutive-skipped-steps", "2", "--eval-size", "0"]
    with pytest.raises(MilesError, match="2 optimizer steps in a row were skipped"):
        train(load_config(args))
    steps = read_metrics(tmp_path / "run")
    assert [r["skipped_step"] for r in steps] == [1.0]  # the second skip stopped it before logging
    assert any("optimizer step skipped: the loss is not finite" in r.getMessage() for r in caplog.records)


def test_cli_exit_status_is_not_zero_when_the_reward_fails(tmp_path):
    args = small_run_args(tmp_path / "run", 2) + ["--custom-rm-path", "tests.reward_fixtures:always_raises"]
    proc = miles_train(args, timeout=120)
    assert proc.returncode == 2
    assert "every reward of rollout 0 failed" in proc.stderr and "Traceback" in proc.stderr


def test_a_run_whose_reward_hangs_on_a_fifth_learns_and_exits(tmp_path):
    """The default task with a reward that hangs on ~20% of calls: every rollout loses just
    those samples, held-out accuracy still rises, and the process exits by itself."""
    args = [
        "--config", str(ROOT / "miles" / "assets" / "default_train.yaml"), "--num-rollout", "8",
        "--rollout-batch-size", "16", "--eval-size", "100", "--eval-interval", "0", "--reward-timeout", "0.2", "--reward-num-workers", "8",
        "--custom-rm-path", hanging_reward(tmp_path), "--output-dir", str(tmp_path / "run"),
        "--no-progress",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = miles_train(args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"hung-reward run: {time.monotonic() - t0:.1f} s")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["rollout"] >= 0]
    assert len(steps) == 8
    for r in steps:  # about a fifth fail in every rollout, never all of them
        assert 0.05 < r["reward_failed"] / 128 < 0.4, r["reward_failed"]
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert evals[-1] > evals[0] + 0.1, evals


def test_a_corrupt_latest_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, caplog):
    save = tmp_path / "ckpt"
    args = small_run_args(tmp_path / "run", 3) + [
        "--save",
        str(save),
        "--save-interval",
        "1",
        "--eval-size",
        "0",
    ]
    train(load_config(args))
    assert (save / "latest").read_text() == "2"
    weights = save / "iter_0000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # torn by a full disk, say
    train(load_config(small_run_args(tmp_path / "run", 4) + ["--load", str(save), "--eval-size", "0"]))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(str(weights) in w and "trying the one before it" in w for w in warned)
    assert [r["rollout"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 3]  # resumed after 1


def test_a_torn_metrics_line_is_skipped_on_resume_and_in_plot(tmp_path, caplog):
    from miles.diagnostics.plot import plot_run

    save = tmp_path / "ckpt"
    args = small_run_args(tmp_path / "run", 2) + ["--save", str(save), "--eval-size", "0"]
    train(load_config(args))
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"rollout": 2, "reward_me')  # killed mid-write
    assert plot_run(tmp_path / "run")
    assert any("line 3 is not whole JSON" in r.getMessage() for r in caplog.records)
    train(load_config(small_run_args(tmp_path / "run", 3) + ["--load", str(save), "--eval-size", "0"]))
    assert [r["rollout"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]


@pytest.mark.parametrize(
    "damage, named",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{"),
            "model.safetensors",
        ),
        (lambda d: (d / "config.json").write_text("{ not json"), "config.json: not valid JSON"),
    ],
    ids=["truncated-safetensors", "invalid-config-json"],
)
def test_a_broken_model_directory_is_named_before_any_work(tmp_path, capsys, damage, named):
    from miles.cli import main
    from miles.models import registry, save_model

    model, tokenizer = registry.load("tiny")
    save_model(model, tmp_path / "model", tokenizer=tokenizer)
    damage(tmp_path / "model")
    code = main(["train", "--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and named in err and str(tmp_path / "model") in err, err
    assert "tokenizer" not in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--batch-size", "0"], "--batch-size: must be >= 1"),
        (["--lr", "-1"], "--lr: must be > 0"),
    ],
)
def test_sft_ranges(capsys, argv, fragment):
    from miles.cli import main

    with pytest.raises(SystemExit) as e:
        main(["sft", "--task", "basic_arithmetic", *argv])
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_debug_logging_shows_config_sync_and_step_timing(tmp_path):
    import os

    args = small_run_args(tmp_path / "run", 1) + ["--eval-size", "0"]
    env = {**os.environ, "MILES_DEBUG": "1"}
    proc = miles_train(args, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in ("resolved configuration", "rollout.rollout_batch_size = 4", "weight sync: in-process buckets",
                 "rollout 0: weight sync v1:", "rollout 0: rollout", "train_rollout_logprob_abs_diff="):  # fmt: skip
        assert line in proc.stderr, line


def test_saved_rollouts_replay_the_run_without_an_engine(tmp_path):
    """Split debugging: a run saves its rollouts; a --debug-train-only run (no engine) trains on
    them and logs the same pg_loss and grad_norm, step for step."""
    pattern = str(tmp_path / "rollouts" / "rollout_{rollout_id}.pt")
    common = ["--eval-size", "0", "--use-kl-loss", "--kl-loss-coef", "0.01"]
    train(load_config(small_run_args(tmp_path / "orig", 3) + common + ["--save-debug-rollout-data", pattern]))
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [f"rollout_{i}.pt" for i in range(3)]
    replay = ["--debug-train-only", "--load-debug-rollout-data", pattern]
    train(load_config(small_run_args(tmp_path / "replay", 3) + common + replay))
    original, replayed = read_metrics(tmp_path / "orig"), read_metrics(tmp_path / "replay")
    assert [r["rollout"] for r in replayed] == [0, 1, 2]
    for a, b in zip(original, replayed):
        for key in ("pg_loss", "grad_norm", "kl_loss", "reward_mean", "train_samples"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["rollout"], key)
    assert (
        replayed[-1]["pg_loss"] != original[0]["pg_loss"]
    )  # the steps differ: a real replay, not a constant
    with pytest.raises(MilesError, match="rollout_3.pt \\(rollout 3\\) does not exist"):
        train(load_config(small_run_args(tmp_path / "longer", 4) + common + replay))


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="per-step peaks need Linux's clear_refs"
)
def test_step_peak_memory_sees_each_steps_own_peak():
    """A 200 MB allocation freed within a step shows in that step's peak and not in the next.
    (Mapped and unmapped directly: whether the allocator hands a freed block back to the OS
    depends on what the process allocated before.)"""
    import mmap

    from miles.devices import step_peak_memory

    step_peak_memory()  # start a window
    base = step_peak_memory()["peak_rss"]
    block = mmap.mmap(-1, 200_000_000)
    for page in range(0, len(block), mmap.PAGESIZE):  # touched: resident
        block[page] = 1
    block.close()
    peak = step_peak_memory()["peak_rss"]
    after = step_peak_memory()["peak_rss"]
    assert peak >= base + 190e6, (base, peak)
    assert after < peak - 150e6, (peak, after)


def test_sft_refuses_to_replace_a_file_with_its_checkpoint(tmp_path, capsys):
    from miles.cli import main

    mine = tmp_path / "notes.txt"
    mine.write_text("the user's own file")
    assert main(["sft", "--task", "basic_arithmetic", "--save", str(mine)]) == 2
    assert f"--save {mine}: is a file" in capsys.readouterr().err
    assert mine.read_text() == "the user's own file"


def test_sft_on_a_small_file_says_which_flag_keeps_records_for_training(tmp_path, capsys):
    from miles.cli import main

    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(20)))
    assert main(["sft", "--data", str(data), "--steps", "1"]) == 2
    assert (
        "all 20 went to the held-out set (--eval-size 200); give a smaller --eval-size"
        in capsys.readouterr().err
    )
    out = tmp_path / "ckpt"
    assert main(["sft", "--data", str(data), "--steps", "2", "--eval-size", "5", "--save", str(out)]) == 0
    assert (out / "config.json").exists()
