"""End to end: `miles train` learns, and a killed run resumes exactly where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.run import train
from tests.conftest import DEFAULT_YAML, ROOT, check_async_run, comparable, small_run_args


def test_kill_and_resume_gives_the_same_run(tmp_path):
    """The driver killed (SIGKILL, by --fault-inject) half-way through writing checkpoint 2, and
    after resuming, again while pushing the weights of rollout 4: resumed twice, the run equals
    the uninterrupted one; no half-written checkpoint is ever read, and none is left."""
    n = 6
    train(load_config(small_run_args(tmp_path / "ref", n)))
    reference = comparable(read_metrics(tmp_path / "ref"))
    assert [r["rollout"] for r in reference] == [-1, *range(n)]

    save = tmp_path / "ckpt"
    args = small_run_args(tmp_path / "run", n) + ["--save", str(save), "--save-interval", "1"]
    args += ["--fault-inject", "driver@checkpoint:2", "--fault-inject", "driver@sync:4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for load, killed_at, torn in (([], 1, 1), (["--load", str(save)], 3, 0)):
        proc = subprocess.run(
            [sys.executable, "-m", "miles.cli", "train", *args, *load],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=240,
        )  # fmt: skip
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        assert int((save / "latest").read_text()) == killed_at
        # every checkpoint directory is whole; a half-written one is only ever a hidden temp dir
        for d in save.glob("iter_*"):
            assert (d / "trainer_state.pt").exists() and (d / "model" / "model.safetensors").exists()
        assert len(list(save.glob(".tmp_iter_*"))) == torn  # checkpoint 2, torn; cleared by the resume

    train(load_config(args + ["--load", str(save)]))
    resumed = comparable(read_metrics(tmp_path / "run"))
    assert [r["rollout"] for r in resumed] == [-1, *range(n)]
    for ref, got in zip(reference, resumed):
        assert ref.keys() == got.keys()
        for k in ref:
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (ref["rollout"], k)
    assert not list(save.glob(".tmp_iter_*"))  # stale temp dirs are cleared on resume
    fired = [
        json.loads(line)["fault"]
        for line in (tmp_path / "run" / "faults_fired.jsonl").read_text().splitlines()
    ]
    assert fired == ["driver@checkpoint:2", "driver@sync:4"]  # each once


def test_training_raises_held_out_accuracy(tmp_path, monkeypatch):
    """GRPO on the shipped base model raises held-out greedy accuracy, and by a margin that the
    same run with a broken loss (advantages negated) cannot reach. Fixed seeds: deterministic.
    Measured: 0.33 -> 0.715 after 14 steps; the broken run falls instead (0.195)."""
    import miles.runtime.learner as learner

    def run(out: Path, steps: int = 14) -> list[float]:
        args = [
            "--config",
            str(DEFAULT_YAML),
            "--num-rollout",
            str(steps),
            "--eval-interval",
            "0",
            "--eval-size",
            "200",
            "--lr-decay-style",
            "constant",  # the job's cosine decay spans its 400 steps, not these few
            "--output-dir",
            str(out),
            "--no-progress",
        ]
        train(load_config(args))
        return [r["eval_accuracy"] for r in read_metrics(out) if "eval_accuracy" in r]

    before, after = run(tmp_path / "grpo")
    trained = [r for r in read_metrics(tmp_path / "grpo") if r["rollout"] >= 0]
    # fp32 on CPU: the trainer routes (almost) every token as the engine did (0.0 measured here)
    assert all(r["routing_mismatch_frac"] < 0.01 and r["routing_mismatch_token_frac"] < 0.05 for r in trained)
    real = learner.compute_advantages
    monkeypatch.setattr(learner, "compute_advantages", lambda *a: [-x for x in real(*a)])
    broken_before, broken_after = run(tmp_path / "broken", steps=6)  # it falls at once
    assert broken_before == before
    print(f"held-out accuracy: {before:.3f} -> {after:.3f}; negated advantages -> {broken_after:.3f}")
    assert after > before + 0.3, (before, after)  # the base's 0.33 rises past 0.63 in 14 steps
    assert after > broken_after + 0.3, (after, broken_after)  # the broken loss falls instead


def test_tensorboard_plot_and_cli_errors(tmp_path, capsys):
    from miles.cli import main

    args = small_run_args(tmp_path / "tb", 2) + ["--use-tensorboard"]
    train(load_config(args))
    events = list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    rewards = [e.value for e in acc.Scalars("reward_mean")]
    assert rewards == pytest.approx(
        [r["reward_mean"] for r in read_metrics(tmp_path / "tb") if "reward_mean" in r]
    )

    # every record has the engine's own split of its time, and each step decoded tokens
    steps = [r for r in read_metrics(tmp_path / "tb") if r["rollout"] >= 0]
    assert all(r["engine_prefill_time"] > 0 and r["engine_decode_tokens"] > 0 for r in steps)
    assert all(
        r["engine_decode_tokens_per_s"] * r["engine_decode_time"] == pytest.approx(r["engine_decode_tokens"])
        for r in steps
    )

    assert main(["plot", str(tmp_path / "tb")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "tb" / "plots").glob("*.png"))
    assert {
        "reward.png",
        "accuracy.png",
        "logprob_mismatch.png",
        "routing_mismatch.png",
        "time.png",
        "lengths.png",
        "memory.png",
        "expert_load.png",
        "expert_usage.png",
        "router.png",
        "expert_share.png",
    } <= set(pngs)
    assert all((tmp_path / "tb" / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    capsys.readouterr()

    assert (
        main(
            [
                "train",
                "--prompt-data",
                str(tmp_path / "missing.jsonl"),
                "--no-progress",
                "--output-dir",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert (
        capsys.readouterr().err.strip()
        == f"miles train: error: --prompt-data {tmp_path / 'missing.jsonl'}: no such file"
    )
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sync", [[], ["--use-zero-copy-sync", "--check-weight-update-equal"]], ids=["bucketed", "zero-copy"]
)
def test_async_one_step_off_policy(tmp_path, monkeypatch, sync):
    """--async-weight-sync: rollout N+1 runs during step N; every sample records its staleness,
    which never passes --max-staleness, and the overlap really happens. With zero-copy the engine
    copies from the trainer's memory before the next training step writes it (checked)."""
    records = check_async_run(tmp_path / "async", ["--async-weight-sync", *sync], monkeypatch)
    if sync:
        assert all(r["sync_moved_bytes"] < 64_000 for r in records if "sync_moved_bytes" in r)


def test_drop_stale_bounds_staleness():
    from types import SimpleNamespace

    from miles.runtime.feed import drop_stale

    def sample(*versions):
        return SimpleNamespace(weight_versions=list(versions), metadata={})

    fresh, one, two = [sample(5)], [sample(4, 5)], [sample(3), sample(5)]
    kept, dropped = drop_stale([fresh, one, two], trainer_version=5, bound=1)
    assert kept == [fresh, one] and dropped == 1
    assert [s.metadata["staleness"] for g in (fresh, one, two) for s in g] == [0, 1, 2, 0]


def test_over_sampling_trains_on_rollout_batch_size_groups(tmp_path, monkeypatch):
    """--over-sampling-batch-size: each step of `miles train` draws that many prompts (the data
    position a checkpoint records moves by it) and, without a filter, still trains on
    rollout_batch_size groups (the global batch)."""
    import torch

    from miles.runtime import feed

    drawn = []
    real = feed.collect_groups
    monkeypatch.setattr(
        feed, "collect_groups", lambda engine, items, *a: drawn.append(len(items)) or real(engine, items, *a)
    )
    args = small_run_args(tmp_path / "run", 2) + ["--over-sampling-batch-size", "6", "--eval-size", "0"]
    train(load_config(args + ["--save", str(tmp_path / "ckpt")]))
    assert drawn == [6, 6]
    assert [r["train_samples"] for r in read_metrics(tmp_path / "run")] == [4 * 4, 4 * 4]
    state = torch.load(tmp_path / "ckpt" / "iter_0000001" / "trainer_state.pt", weights_only=False)
    assert state["data_position"] == 12


def test_a_new_run_in_a_used_directory_keeps_the_old_metrics_apart(tmp_path):
    train(load_config(small_run_args(tmp_path / "run", 1)))
    first = read_metrics(tmp_path / "run")
    train(load_config(small_run_args(tmp_path / "run", 2)))
    assert [r["rollout"] for r in read_metrics(tmp_path / "run")] == [-1, 0, 1]  # not appended
    kept = [json.loads(line) for line in (tmp_path / "run" / "metrics.1.jsonl").read_text().splitlines()]
    assert kept == first


def test_verify_logprobs_stops_a_run_whose_mismatch_exceeds_the_threshold(tmp_path):
    """--verify-logprobs: with a threshold below the measured gap (~1e-7 here) the run stops at
    rollout 0 naming the gap and the remedies; at the default threshold (0.1) it runs."""
    from miles.errors import MilesError

    args = small_run_args(tmp_path / "strict", 2) + [
        "--verify-logprobs",
        "--verify-logprobs-threshold",
        "1e-12",
    ]
    with pytest.raises(
        MilesError,
        match=r"--verify-logprobs: mean \|logp_train - logp_rollout\| = .* at rollout 0; try --use-r3",
    ):
        train(load_config(args))
    train(load_config(small_run_args(tmp_path / "default", 2) + ["--verify-logprobs"]))
    assert [r["rollout"] for r in read_metrics(tmp_path / "default")] == [-1, 0, 1]


def test_profile_writes_a_trace_of_the_marked_phases(tmp_path):
    """--profile-dir (implies --profile): a Chrome trace holding the three phases of the recorded
    steps and the operators run inside them, and a summary table of the top operators."""
    import json

    args = small_run_args(tmp_path / "run", 3) + ["--rollout-batch-size", "2", "--eval-size", "0"]
    cfg = load_config(args + ["--profile-dir", str(tmp_path / "prof")])
    assert cfg.logging.profile
    train(cfg)
    events = json.loads((tmp_path / "prof" / "trace.json").read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    for phase in ("miles.rollout", "miles.train", "miles.sync"):
        assert names.count(phase) == 2, phase  # the two active steps, not the warm-up one
    train_spans = [e for e in events if e.get("name") == "miles.train"]
    inside = [  # matmuls recorded inside a train phase
        e for e in events
        if e.get("name") in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")
        and any(t["ts"] <= e["ts"] <= t["ts"] + t["dur"] for t in train_spans)
    ]  # fmt: skip
    assert inside
    summary = (tmp_path / "prof" / "summary.txt").read_text()
    assert "Self CPU" in summary and "aten::" in summary


def test_profile_says_when_the_run_is_shorter_than_what_it_records(tmp_path, caplog):
    from miles.runtime.profiling import StepProfiler

    with caplog.at_level("WARNING", logger="miles"):
        StepProfiler(tmp_path, steps=2).close()
    assert any("the trace holds 1" in r.getMessage() for r in caplog.records)


def test_default_job_settings_run_on_a_dense_model(tmp_path):
    """The default job's settings (R3 on) on a dense checkpoint: routing replay has nothing to
    replay, so it is turned off instead of failing the first training step."""
    from miles.models.checkpoint import save_model
    from miles.models.tokenizer import byte_tokenizer
    from tests.conftest import random_model

    tokenizer = byte_tokenizer()
    save_model(random_model("llama", vocab_size=len(tokenizer)), tmp_path / "dense", tokenizer=tokenizer)
    cfg = load_config(small_run_args(tmp_path / "run", 1) + ["--model", str(tmp_path / "dense")])
    assert cfg.algo.use_r3  # from default_train.yaml
    train(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["rollout"] for r in rows if "loss" in r] == [0] and "routing_mismatch_frac" not in rows[-1]


@pytest.mark.parametrize(
    "mode",
    [
        ["--async-weight-sync"],
        ["--partial-rollout", "--over-sampling-batch-size", "6", "--rollout-max-response-len", "12"],
        ["--draft-model", "eagle", "--online-sft-interval", "1", "--no-spec-adaptive"],  # adaptive: by timing
        [
            "--async-weight-sync",
            "--partial-rollout",
            "--over-sampling-batch-size",
            "6",
            "--rollout-max-response-len",
            "12",
        ],
        [
            "--rollout-mode",
            "fully-async",
            "--over-sampling-batch-size",
            "6",
            "--rollout-max-response-len",
            "12",
        ],
    ],  # fmt: skip
    ids=["async", "partial", "online-draft", "async-partial", "fully-async"],
)
def test_resume_continues_each_mode_as_if_never_stopped(tmp_path, mode):
    """Stopped after rollout 1 and resumed, a run equals the uninterrupted one: the checkpoint
    holds the rollout running ahead (async), the partial groups carried over, and the online
    draft's weights, optimizer, pending and replayed rollouts."""
    import shutil

    n = 3
    train(
        load_config(
            small_run_args(tmp_path / "ref", n)
            + mode
            + ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
        )
    )
    stopped = tmp_path / "stopped"  # the run as a stop after rollout 1 leaves it
    shutil.copytree(tmp_path / "ckpt" / "iter_0000001", stopped / "iter_0000001")
    (stopped / "latest").write_text("1")
    shutil.copy(tmp_path / "ref" / "metrics.jsonl", tmp_path / "run.jsonl")
    (tmp_path / "run").mkdir()
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "\n".join(lines[:3]) + "\n"
    )  # the base's eval, rollouts 0-1
    train(load_config(small_run_args(tmp_path / "run", n) + mode + ["--load", str(stopped)]))
    reference, resumed = (
        comparable(read_metrics(tmp_path / "ref")),
        comparable(read_metrics(tmp_path / "run")),
    )
    assert [r["rollout"] for r in resumed] == [r["rollout"] for r in reference] == [-1, *range(n)]
    for ref, got in zip(reference, resumed):
        for k in ref:
            if "seconds" in k or "per_s" in k or k.startswith("spec_draft_time"):
                continue  # how long, not what
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (ref["rollout"], k)


def test_a_checkpoint_of_another_mode_or_format_is_said_or_refused(tmp_path, caplog):
    """An async + partial checkpoint resumed without those modes says what it leaves unused; one
    without the format stamp (older) loads with a warning that the resume is not exact; one of a
    newer format is refused, naming it, and no older checkpoint is loaded in its place."""
    import torch

    from miles.errors import CheckpointError

    ckpt = tmp_path / "ckpt"
    mode = ["--async-weight-sync", "--partial-rollout", "--over-sampling-batch-size", "6"]
    train(
        load_config(small_run_args(tmp_path / "a", 3) + mode + ["--save", str(ckpt), "--save-interval", "1"])
    )
    (ckpt / "latest").write_text("1")  # stopped after rollout 1: the rollout ahead is rollout 2's
    with caplog.at_level("WARNING", logger="miles"):
        train(load_config(small_run_args(tmp_path / "b", 3) + ["--load", str(ckpt)]))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "a rollout generated ahead (a --async-weight-sync run)" in said
    assert "partial groups carried over (a --partial-rollout run)" in said
    assert [r["rollout"] for r in read_metrics(tmp_path / "b") if "loss" in r] == [
        2
    ]  # resumed after rollout 1

    state_file = ckpt / "iter_0000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["format"] == 2
    torch.save({k: v for k, v in state.items() if k not in ("format", "ahead", "partial")}, state_file)
    caplog.clear()
    with caplog.at_level("WARNING", logger="miles"):
        train(load_config(small_run_args(tmp_path / "c", 3) + mode + ["--load", str(ckpt)]))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "older format (no ahead state)" in said and "older format (no partial state)" in said

    torch.save({**state, "format": 99}, state_file)
    with pytest.raises(CheckpointError, match="newer miles \\(checkpoint format 99"):
        train(load_config(small_run_args(tmp_path / "d", 3) + ["--load", str(ckpt)]))


@pytest.mark.parametrize(
    "mode",
    [
        ["--async-weight-sync"],
        ["--async-weight-sync", "--partial-rollout", "--over-sampling-batch-size", "6"],
    ],
    ids=["async", "async-partial"],
)
def test_extending_a_finished_run_continues_it_as_one_longer_run(tmp_path, mode):
    """A finished 2-rollout run extended to 4 (the same command with --num-rollout 4 --load): its
    last checkpoint holds the rollout a longer run would have generated ahead of it (and the
    partial groups), so the extension's first rollout is the 4-rollout run's rollout 2 (async +
    partial: later rollouts take weights in flight, at a moment the machine's timing picks, so
    only that one is compared)."""
    n = 4
    args = small_run_args(tmp_path / "whole", n) + mode + ["--eval-size", "0"]
    train(load_config(args))
    part = (
        small_run_args(tmp_path / "part", 2) + mode + ["--eval-size", "0", "--save", str(tmp_path / "ckpt")]
    )
    train(load_config(part))
    extended = [a if a != "2" or b != "--num-rollout" else "4" for b, a in zip(["", *part], part)]
    train(load_config(extended + ["--load", str(tmp_path / "ckpt")]))
    whole, resumed = comparable(read_metrics(tmp_path / "whole")), comparable(read_metrics(tmp_path / "part"))
    assert [r["rollout"] for r in resumed] == list(range(n))
    compared = range(n) if "--partial-rollout" not in mode else [2]
    for i in compared:
        for k in whole[i]:
            assert resumed[i][k] == pytest.approx(whole[i][k], rel=1e-5, abs=1e-6), (i, k)
