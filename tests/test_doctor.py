"""`miles doctor`: each check named on a real short run whose setting was broken on purpose (and
only that check), the remedy flags it lists accepted by `miles train`, healthy runs healthy."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from miles.config import load_config
from miles.doctor import diagnose, load_run
from miles.doctor.checks import THRESHOLDS, weight_sync_share
from miles.errors import MilesError
from tests.conftest import DEFAULT_YAML

BASE = [
    "--config", str(DEFAULT_YAML), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--eval-size", "16", "--eval-interval", "0", "--micro-batch-size", "32", "--no-progress",
]  # fmt: skip


def run_job(root: Path, name: str, *flags: str, steps: int = 5, stops: str | None = None) -> Path:
    """A short default-job run with `flags`. It must run all its steps, unless `stops` is given:
    then it must stop itself with that error (a run that cannot learn, e.g. NaN steps), leaving
    the metrics the doctor reads. Any other failure fails the test."""
    from miles.run import train

    out = root / name
    argv = [*BASE, "--num-rollout", str(steps), "--output-dir", str(out), *flags]
    if stops is None:
        train(load_config(argv))
        assert len(load_run(out).steps) == steps, f"{name}: the run ended early"
    else:
        with pytest.raises(MilesError, match=stops):
            train(load_config(argv))
    return out


def symptoms(run_dir: Path, compare: Path | None = None) -> tuple[set[str], list]:
    findings = diagnose(load_run(run_dir), load_run(compare) if compare else None)
    return {f.check for f in findings}, findings


def assert_remedies_accepted(run_dir: Path, findings) -> None:
    """Every flag a finding lists loads on top of the run's own configuration."""
    for finding in findings:
        for remedy in finding.remedies:
            if remedy.flags:
                load_config(["--config", str(run_dir / "config.yaml"), *remedy.flags])


def remedy_flags(findings) -> list[list[str]]:
    return [r.flags for f in findings for r in f.remedies]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("doctor")


@pytest.fixture(scope="module")
def healthy(runs) -> Path:
    return run_job(runs, "healthy")


def test_default_job_run_is_healthy(healthy, capsys):
    from miles.cli import main

    assert symptoms(healthy)[0] == set()
    assert main(["doctor", str(healthy)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("healthy") and len(out) == 2


def test_nan_steps_are_named_with_their_consequences(runs, capsys):
    from miles.cli import main

    bad = run_job(runs, "nan", "--lr", "1", "--num-steps-per-rollout", "4", "--clip-grad", "0")
    names, findings = symptoms(bad)
    assert names == {"loss_explosion"}
    assert {"reward_collapse"} <= {f.check for f in findings[0].explains}  # folded under the cause
    flags = remedy_flags(findings)
    assert ["--lr", "0.1"] in flags and ["--clip-grad", "1.0"] in flags and ["--eps-clip-c", "3"] in flags
    assert_remedies_accepted(bad, findings)
    assert main(["doctor", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["healthy"] and report["findings"][0]["check"] == "loss_explosion"


def test_reward_collapse_and_its_remedy(runs, healthy):
    bad = run_job(runs, "collapse", "--lr", "0.03")
    names, findings = symptoms(bad)
    assert names == {"reward_collapse"}
    assert ["--lr", "0.003"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)
    fixed = run_job(runs, "collapse-fixed", "--lr", "0.003")
    assert "reward_collapse" not in symptoms(fixed)[0]
    # against the healthy run, the gap is named and the differing setting offered
    names, findings = symptoms(bad, compare=healthy)
    assert "accuracy_gap" in names
    gap = next(f for f in findings if f.check == "accuracy_gap")
    assert ["--lr", "0.0003"] in remedy_flags([gap])
    assert_remedies_accepted(bad, [gap])
    assert "accuracy_gap" not in symptoms(healthy, compare=healthy)[0]


def test_fp8_rollout_mismatch_then_tis_and_r3_remove_it(runs):
    bad = run_job(runs, "fp8-bare", "--fp8-rollout-only", "--no-use-r3", "--no-use-tis", steps=3)
    names, findings = symptoms(bad)
    assert names == {"logprob_mismatch", "routing_mismatch"}
    run = load_run(bad)
    assert run.median("kl_rollout_train_k3") > THRESHOLDS["mismatch_k3"]
    flags = remedy_flags(findings)
    assert ["--use-tis"] in flags and ["--use-r3"] in flags
    assert_remedies_accepted(bad, findings)
    assert ["--no-fp8-rollout-only", "--fp8-recipe", "blockwise"] in flags
    fixed = run_job(runs, "fp8-fixed", "--fp8-rollout-only", "--use-tis", "--use-r3", steps=3)
    assert symptoms(fixed)[0] == set()
    assert load_run(fixed).median("tis_clipfrac") < THRESHOLDS["tis_clipfrac"]
    # unified FP8 removes the mismatch itself, with neither correction
    unified = run_job(
        runs, "fp8-unified", "--fp8-recipe", "blockwise", "--no-use-r3", "--no-use-tis", steps=3
    )
    assert symptoms(unified)[0] == set()
    assert load_run(unified).median("kl_rollout_train_k3") < THRESHOLDS["mismatch_k3"] / 100


def test_int4_rollout_without_qat_is_a_mismatch_and_qat_removes_it(runs):
    bad = run_job(runs, "int4-bare", "--int4-rollout-only", "--no-use-r3", "--no-use-tis", steps=3)
    names, findings = symptoms(bad)
    assert "logprob_mismatch" in names and names <= {"logprob_mismatch", "routing_mismatch"}
    assert ["--no-int4-rollout-only", "--int4-qat"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)
    qat = run_job(runs, "int4-qat", "--int4-qat", "--no-use-r3", "--no-use-tis", steps=3)
    assert symptoms(qat)[0] == set()
    assert load_run(qat).median("kl_rollout_train_k3") < THRESHOLDS["mismatch_k3"] / 100
    # what the doctor adds for an INT4 QAT run that trails a reference: each a valid invocation
    from miles.doctor.checks import _int4_remedies

    offered = [r.flags for r in _int4_remedies(load_run(qat), accuracy=True)]
    assert offered[:2] == [["--int4-group-size", "64"], ["--int4-skip-layers", "self_attn"]]
    assert [f[0] for f in offered[2:]] == ["--warmup-steps", "--lr"]
    for flags in offered:
        load_config(["--config", str(qat / "config.yaml"), *flags])


def test_too_tight_a_tis_band_clips_most_tokens(runs):
    bad = run_job(runs, "fp8-tight", "--fp8-rollout-only", "--tis-threshold", "0.99", steps=4)
    names, findings = symptoms(bad)
    assert names == {"tis_clipping"}
    assert ["--tis-threshold", "0.9"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)


def test_slow_weight_sync(runs, healthy):
    # 1 KiB buckets: one tensor per bucket, 126 copies per sync, on a small batch
    bad = run_job(runs, "tiny-buckets", "--sync-bucket-size", "1024", "--rollout-batch-size", "2", steps=4)
    names, findings = symptoms(bad)
    assert names == {"weight_sync_share"}
    assert ["--sync-bucket-size", str(512 * 1024**2)] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)
    # the healthy run is that remedy (default 512 MiB buckets): its sync share is small
    share = [r["sync_seconds"] / r["step_time"] for r in load_run(healthy).steps]
    assert statistics.median(share) < THRESHOLDS["sync_share"]  # the doctor's measure (one step can hiccup)
    # one slow step (a loaded machine) is not the setting: healthy steps with one step of the
    # slow run among them stay healthy, in a 2-step run and a 4-step run
    run, slow = load_run(healthy), load_run(bad)
    for n in (2, 4):
        assert weight_sync_share(replace(run, records=[slow.steps[0], *run.steps[1:n]]), None) is None
    # two steady steps of the slow run are the setting (its first also warms up: a longer step,
    # a smaller share, which a busy machine can push under the threshold)
    assert weight_sync_share(replace(run, records=slow.steps[1:3]), None) is not None


def test_truncation(runs):
    bad = run_job(runs, "short", "--rollout-max-response-len", "2", steps=4)
    names, findings = symptoms(bad)
    assert names == {"truncation"}
    assert ["--rollout-max-response-len", "4"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)


def test_memory_that_grows_to_a_working_set_and_stays_is_no_leak():
    """Peak memory that rises over the first steps (batches growing to their size, freed memory
    kept in the heap) and then stays flat is not flagged; the same rise kept up to the end is."""
    from miles.doctor.checks import memory_growth
    from miles.doctor.run import RunRecord

    def run_of(gb: list[float]) -> RunRecord:
        steps = [{"rollout": i, "reward_mean": 0.5, "mem_driver_peak_rss_gb": v} for i, v in enumerate(gb)]
        return RunRecord(Path("."), {}, steps)

    plateau = [6.0, 6.4, 7.2, 9.0, 11.0, 12.8] + [12.85] * 30
    assert memory_growth(run_of(plateau), None) is None
    leak = [6.0 + 0.2 * i for i in range(36)]
    assert memory_growth(run_of(leak), None) is not None


def test_memory_growth_from_a_leaky_plugin(runs):
    from tests import reward_fixtures

    try:
        bad = run_job(
            runs, "leak", "--dynamic-sampling-filter-path", "tests.reward_fixtures:leaky_filter", steps=6
        )
    finally:
        reward_fixtures.LEAKED.clear()
    names, findings = symptoms(bad)
    assert names == {"memory_growth"}
    assert findings[0].evidence[0].metric == "mem_driver_peak_rss_gb"
    assert_remedies_accepted(bad, findings)


def test_collapsed_router_is_an_expert_imbalance(runs):
    from scripts.collapse_router import collapse_router

    model = collapse_router("tiny", str(runs / "tiny-collapsed"))
    bad = run_job(runs, "collapsed", "--model", model)
    names, findings = symptoms(bad)
    assert names == {"expert_imbalance"}
    assert ["--aux-loss-coef", "0.01"] in remedy_flags(findings)
    assert ["--moe-capacity-factor", "1.25"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)
    assert load_run(bad).median("expert_load_max_over_balanced") > 2.5
    # capacity bounds the busiest expert near 1.25x the balanced share, by dropping the slots over it
    capped = run_job(runs, "collapsed-capped", "--model", model, "--moe-capacity-factor", "1.25", steps=2)
    # (the ceil of each forward adds slack: the engine replayed by R3 decodes a few rows per step)
    assert load_run(capped).median("expert_load_max_over_balanced") < 1.4
    names, findings = symptoms(capped)
    assert "expert_drops" in names
    assert ["--moe-capacity-factor", "2.5"] in remedy_flags(findings)
    assert_remedies_accepted(capped, findings)


def test_doctor_errors_name_the_problem(tmp_path, capsys):
    from miles.cli import main

    assert main(["doctor", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_env_report(capsys):
    import torch

    from miles.cli import main

    assert main(["doctor", "--env", "--json", "--model", "tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__
    assert report["model"]["linear_input_sizes"] == [128]  # tiny's hidden and expert sizes
    assert report["model"]["int4_group_sizes"] == [16, 32, 64, 128]
    assert report["shared_memory"]["dev_shm_total_gb"] > 0


def test_a_reward_drop_within_sampling_noise_is_not_a_collapse(tmp_path):
    """The same fall (0.5 -> 0.2) is a collapse over 256 samples a step, noise over 4."""
    from miles.doctor.checks import CHECKS

    def record(samples_per_step: int):
        rewards = [0.5, 0.5, 0.45, 0.5, 0.2, 0.2]
        run = tmp_path / str(samples_per_step)
        run.mkdir()
        lines = [
            json.dumps({"rollout": i, "reward_mean": r, "train_samples": samples_per_step})
            for i, r in enumerate(rewards)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return load_run(run)

    assert CHECKS["reward_collapse"].run(record(256), None) is not None
    assert CHECKS["reward_collapse"].run(record(4), None) is None


TOOL_RUN = ["--tool-path", "calculator", "--rollout-max-response-len", "48", "--max-turn-tokens", "4"]


def test_a_tool_error_storm_names_its_kind_and_folds_the_turn_limit_under_it(runs):
    bad = run_job(runs, "tool-storm", *TOOL_RUN, "--tool-call-parser", "tests.agent_fixtures:unknown_calls",
                  "--max-turns", "2", steps=2)  # fmt: skip
    names, findings = symptoms(bad)
    assert names == {"tool_errors"}
    # failed calls are retried to the limit, and their error texts fill the budget
    assert {f.check for f in findings[0].explains} <= {"turn_limit", "trajectory_budget"}
    assert findings[0].explains
    assert "unknown_tool" in findings[0].cause and "miles sft" in findings[0].remedies[0].why
    assert_remedies_accepted(bad, findings)


def test_the_turn_limit_and_its_remedy(runs):
    parser = ["--tool-call-parser", "tests.agent_fixtures:calls_half_the_time"]
    bad = run_job(runs, "turn-limit", *TOOL_RUN, *parser, "--max-turns", "1", steps=2)
    names, findings = symptoms(bad)
    assert names == {"turn_limit"}
    assert ["--max-turns", "2"] in remedy_flags(findings)
    assert_remedies_accepted(bad, findings)
    fixed = run_job(runs, "turn-limit-fixed", *TOOL_RUN, *parser, "--max-turns", "4", steps=2)
    assert "turn_limit" not in symptoms(fixed)[0]
