"""Held-out list of bad `miles train` invocations: each fails fast, names the flag or file, loses nothing."""

from __future__ import annotations

import json
import time

import pytest

from miles.cli import main
from tests.conftest import random_model


def files(tmp_path):
    """Paths the cases point at: a plain file, an empty directory, bad prompt files."""
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    (tmp_path / "null_prompt.jsonl").write_text(json.dumps({"input": None, "label": "1"}) + "\n")
    (tmp_path / "bad.yaml").write_text("rollout: [unclosed\n")
    (tmp_path / "typo.yaml").write_text("rollout:\n  rollout_batch_sise: 4\n")
    return tmp_path


CASES = [
    (["--fault-inject", "engine"], "--fault-inject 'engine': expected TARGET@POINT:ROLLOUT"),
    (["--fault-inject", "gpu@rollout:1"], "TARGET is one of driver, engine, rank, reward"),
    (["--fault-inject", "driver@train:1"], "POINT is one of rollout, step, sync, checkpoint"),
    (
        ["--fault-inject", "engine@rollout:1"],
        "no engine to kill; it needs Ray engine actors: add --rollout-num-gpus 2",
    ),
    (["--fault-inject", "reward@rollout:1"], "no reward to kill; it needs reward worker processes"),
    (["--fault-inject", "driver@checkpoint:1"], "writes no checkpoint; add --save DIR"),
    (["--fault-inject", "driver@step:99"], "ROLLOUT must be below --num-rollout 1"),
    (["--eps-clip", "-1"], "--eps-clip must be in (0, 1), got -1.0"),
    (["--reward-timeout", "0"], "--reward-timeout must be > 0, got 0.0"),
    (["--reward-timeout", "-5"], "--reward-timeout must be > 0"),
    (["--eval-interval", "-1"], "--eval-interval must be >= 0, got -1"),
    (["--save-interval", "-1"], "--save-interval must be >= 0"),
    (["--eval-size", "-5"], "--eval-size must be >= 0"),
    (["--update-weights-interval", "0"], "--update-weights-interval must be >= 1"),
    (["--rollout-temperature", "-1"], "--rollout-temperature must be >= 0"),
    (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1]"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1]"),
    (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or >= 1"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be > 0"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    (["--clip-grad", "-0.5"], "--clip-grad must be >= 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--num-rollout", "0"], "--num-rollout must be >= 1"),
    (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt must be >= 2"),
    (["--kl-loss-coef", "0.5"], "--kl-loss-coef 0.5 has no effect without --use-kl-loss"),
    (["--tis-clip-low", "3"], "--tis-clip-low 3.0 is above --tis-clip 2.0"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c must be > 1"),
    (["--sync-bucket-size", "0"], "--sync-bucket-size must be >= 1"),
    (["--max-consecutive-skipped-steps", "-1"], "--max-consecutive-skipped-steps must be >= 0"),
    (["--reward-num-workers", "0"], "--reward-num-workers must be >= 1"),
    (["--min-lr", "1"], "--min-lr 1.0 is above --lr"),
    (["--debug-rollout-only", "--save", "{tmp}/ckpt"], "--debug-rollout-only never trains"),
    (["--output-dir", "{tmp}/a_file"], "--output-dir {tmp}/a_file: is a file"),
    (["--save", "{tmp}/a_file"], "--save {tmp}/a_file: is a file"),
    (["--load", "{tmp}/missing"], "--load {tmp}/missing: no such directory"),
    (["--load", "{tmp}/empty"], "--load {tmp}/empty: holds no checkpoint"),
    (["--prompt-data", "{tmp}/null_prompt.jsonl"], "record 0: 'input' (--input-key) is None"),
    (["--prompt-data", "{tmp}/nothing.jsonl"], "--prompt-data {tmp}/nothing.jsonl: no such file"),
    (["--config", "{tmp}/bad.yaml"], "--config {tmp}/bad.yaml: not valid YAML"),
    (
        ["--config", "{tmp}/typo.yaml"],
        "unknown key rollout.rollout_batch_sise; did you mean --rollout-batch-size?",
    ),
    (["--rollout-max-response-len", "100000"], "--rollout-max-response-len 100000 does not fit the context"),
    (["--model", "{tmp}/missing_model"], "--model '{tmp}/missing_model': no such file or directory"),
    (["--rollout-batch-sise", "4"], "unknown flag --rollout-batch-sise; did you mean --rollout-batch-size?"),
    (["--advantage-estimator", "ppo2"], "--advantage-estimator"),
    (["--global-batch-size", "7"], "must equal --global-batch-size 7"),
    (
        ["--rollout-batch-size", "3", "--over-sampling-batch-size", "2"],
        "--over-sampling-batch-size must be >=",
    ),
    (
        ["--rollout-batch-size", "3", "--over-sampling-batch-size", "2"],
        "--over-sampling-batch-size must be >=",
    ),
    (["--colocate", "--async-weight-sync"], "--colocate with --async-weight-sync"),
    (
        ["--int4-qat", "--int4-group-size", "256"],
        "--int4-group-size 256 does not divide the input size 128 of model.layers.0.self_attn.q_proj",
    ),
    (
        ["--int4-rollout-only", "--int4-skip-layers", "atention"],
        "--int4-skip-layers: 'atention' matches no layer",
    ),
    (["--save-debug-rollout-data", "{tmp}/r.pt"], "the pattern needs {rollout_id}"),
    (["--debug-train-only"], "--debug-train-only and --load-debug-rollout-data go together"),
    (
        ["--debug-train-only", "--load-debug-rollout-data", "r_{rollout_id}.pt", "--debug-rollout-only"],
        "--debug-train-only and --debug-rollout-only exclude each other",
    ),
    (
        [
            "--debug-train-only",
            "--load-debug-rollout-data",
            "r_{rollout_id}.pt",
            "--actor-num-gpus-per-node",
            "2",
        ],
        "--debug-train-only runs in one process",
    ),
    # flags that do nothing without a companion name the flag to add
    (["--spec-lookahead", "3"], "--spec-lookahead has no effect without a draft; add --draft-model"),
    (["--draft-lr", "0.01"], "--draft-lr has no effect without a draft; add --draft-model"),
    (["--partial-rollout"], "add --over-sampling-batch-size above 2"),
    (["--save-interval", "2"], "add --save DIR"),
    (["--max-staleness", "2"], "add --rollout-mode fully-async or --async-weight-sync"),
    (["--resume-if-present"], "add --load DIR"),
    (["--opsm-delta", "0.01"], "add --use-opsm"),
    (["--mismatch-dump-samples", "2"], "add --mismatch-dump-interval N"),
    (
        ["--max-tokens-per-gpu", "512"],
        "--max-tokens-per-gpu sizes the micro-batches of --use-dynamic-batch-size",
    ),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu N"),
    (["--memory-budget-gb", "4"], "--auto-batch and --memory-budget-gb go together"),
    (["--true-on-policy-mode", "--async-weight-sync"], "--true-on-policy-mode with --async-weight-sync"),
]


# a tiny job underneath, so a case that is wrongly accepted costs seconds, not the default job's minutes
TINY_JOB = [
    "--num-rollout",
    "1",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--eval-size",
    "2",
]


@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_invocation_fails_fast_naming_the_flag(tmp_path, capsys, argv, fragment):
    tmp = files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    t0 = time.perf_counter()
    out = [] if "--output-dir" in argv else ["--output-dir", str(tmp / "out")]
    try:
        code = main(["train", *TINY_JOB, *out, *argv])
    except SystemExit as e:  # argparse's own refusals (unknown choice) exit 2 the same way
        code = e.code
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment.replace("{tmp}", str(tmp)) in err, err
    assert elapsed < 10, elapsed
    assert not (tmp / "out" / "metrics.jsonl").exists()  # no work was started
    assert len(CASES) >= 30


def test_more_bad_input_is_one_clear_error(tmp_path, capsys):
    """Inputs that used to end in a raw traceback: each is one line naming what to change."""
    from miles.cli import main

    (tmp_path / "latin1.jsonl").write_bytes(b'{"input": "caf\xe9", "label": "1"}\n')
    (tmp_path / "a_file").write_text("x")
    base = TINY_JOB
    cases = [
        (["train", *base, "--prompt-data", str(tmp_path / "latin1.jsonl")], "line 1: not UTF-8 text"),
        (["train", *base, "--output-dir", str(tmp_path / "a_file" / "run")], "--output-dir"),
        (["serve", "--port", "99999"], "--port 99999: a TCP port is 0-65535"),
    ]
    for argv, fragment in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (argv, err)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"rollout": "zero", "reward_mean": 1}\n{"rollout": 0, "reward_mean": 0.5}\n'
    )
    assert main(["doctor", str(run)]) in (0, 1)  # the malformed record is skipped with a warning


def test_errors_name_the_flag_the_user_gave(tmp_path):
    """A missing draft checkpoint is --draft-model's, not --model's; --env-path says what it takes;
    a misspelt task gets the names that look like it."""
    from miles.errors import ConfigError, MilesError
    from miles.multiagent.co_evolution import build_env
    from miles.rollout.drafts import load_draft

    cfg = load_config_for(["--draft-model", str(tmp_path / "nowhere")])
    with pytest.raises(MilesError, match=r"^--draft-model '.*nowhere': no such file"):
        load_draft(cfg.speculative, random_model("qwen3"), "cpu")
    with pytest.raises(ConfigError, match=r"--env-path 'poker': expected one of \['kuhn', 'kuhn_poker', "):
        build_env("poker", 0)
    from miles.data.prompts import task_prompts

    with pytest.raises(ConfigError, match=r"close names: \['basic_arithmetic'"):
        task_prompts("arithmetic", 4, 0, {})


def load_config_for(flags):
    from miles.config import load_config

    return load_config(["--eval-size", "0", *flags])
