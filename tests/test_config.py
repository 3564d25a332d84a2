"""Configuration: flags, aliases, YAML, and one clear error per broken setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from miles.cli import main
from miles.config import build_train_parser, load_config
from miles.config.loader import FIELDS
from miles.errors import ConfigError


def test_defaults_aliases_and_yaml_override(tmp_path):
    cfg = load_config([])
    assert cfg.train.lr == 1e-6 and cfg.rollout.rollout_temperature == 1.0 and cfg.algo.eps_clip == 0.2
    assert cfg.train.global_batch_size == 32 * 8  # derived: rollout_batch_size x n_samples / steps
    cfg = load_config(
        [
            "--use-rollout-routing-replay",
            "--update-weight-buffer-size",
            "1024",
            "--lr-warmup-iters",
            "7",
            "--moe-aux-loss-coeff",
            "0.01",
        ]
    )
    assert (
        cfg.algo.use_r3
        and cfg.sync.sync_bucket_size == 1024
        and cfg.train.warmup_steps == 7
        and cfg.train.aux_loss_coef == 0.01
    )
    y = tmp_path / "run.yaml"
    y.write_text("train:\n  lr: 3.0e-5\nrollout_batch_size: 4\nn_samples_per_prompt: 2\nuse_tis: true\n")
    cfg = load_config(["--config", str(y), "--lr", "1e-4"])
    assert cfg.train.lr == 1e-4  # the flag beats the file
    assert cfg.rollout.rollout_batch_size == 4 and cfg.algo.use_tis and cfg.train.global_batch_size == 8


def test_tis_threshold_turns_tis_on():
    cfg = load_config(["--tis-threshold", "0.9"])
    assert cfg.algo.use_tis and cfg.algo.tis_threshold == 0.9


def test_every_guide_flag_is_a_flag_of_miles_train():
    """The guide's remedy flags are option strings of `miles train`, matched whole (not as a
    prefix of a longer flag); every flag docs/troubleshooting.md names is a flag of some miles
    command."""
    options = {s for action in build_train_parser()._actions for s in action.option_strings}
    guide_text = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", guide_text))
    required = {
        "--fp8-recipe", "--use-r3", "--lr", "--warmup-steps", "--warmup-precision", "--fp8-format",
        "--fp8-dynamic-scaling", "--fp8-skip-layers", "--use-tis", "--tis-threshold", "--verify-logprobs",
        "--r3-buffer-size", "--deterministic-expert-routing", "--int4-group-size", "--int4-skip-layers",
        "--spec-lookahead", "--online-sft-interval", "--draft-lr", "--draft-ema-decay", "--reinit-draft-interval",
        "--profile-speculative", "--use-zero-copy-sync", "--sync-bucket-size", "--colocate", "--async-weight-sync",
        "--aux-loss-coef", "--moe-capacity-factor", "--expert-model-parallel-size", "--micro-batch-size",
        "--offload-experts", "--co-evolution-interval", "--log-level", "--profile", "--profile-dir",
    }  # fmt: skip
    assert required <= options, sorted(required - options)
    assert required <= named, sorted(required - named)
    from miles.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices.values()
    every = options | {s for parser in commands for action in parser._actions for s in action.option_strings}
    assert named <= every, sorted(named - every)  # each flag the guide names exists, whole


def test_help_explains_without_figures():
    """--help strings stay short and carry no measured figure (those live in docs/)."""
    for action in build_train_parser()._actions:
        text = action.help or ""
        assert len(text) <= 360, (action.dest, len(text))  # 300 of prose plus range and default
        assert not re.search(r"\d+(\.\d+)?\s*(x\b|%|ms\b|GB/s|tok/s)", text), (action.dest, text)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--lrr", "1e-5"], "unknown flag --lrr; did you mean --lr?"),
        (
            ["--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--global-batch-size", "5"],
            "--global-batch-size 5",
        ),
        (["--num-steps-per-rollout", "3"], "do not split into --num-steps-per-rollout 3"),
        (["--lr", "abc"], "--lr expects float, got 'abc'"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--tis-threshold", "1.5"], "--tis-threshold must be in (0, 1]"),
        (["--fp8-format", "e4m3"], "--fp8-format has no effect without FP8"),
        (
            ["--fp8-recipe", "blockwise", "--fp8-dynamic-scaling"],
            "--fp8-dynamic-scaling changes only --fp8-recipe delayed",
        ),
        (
            ["--fp8-recipe", "blockwise", "--warmup-precision", "bf16"],
            "--warmup-precision bf16 needs --warmup-steps",
        ),
        (
            ["--warmup-precision", "bf16", "--warmup-steps", "3"],
            "--warmup-precision has no effect without FP8 or INT4",
        ),
        (["--online-sft-interval", "5"], "--online-sft-interval has no effect without a draft"),
        (
            ["--draft-model", "ngram", "--online-sft-interval", "5"],
            "--draft-model ngram has no weights to train",
        ),
        (["--draft-model", "auto", "--draft-ema-decay", "0.99"], "act on a draft trained online"),
        (["--draft-model", "ngram", "--draft-layers", "2"], "--draft-layers sizes --draft-model auto"),
        (
            ["--draft-model", "auto", "--draft-vocab-size", "2048"],
            "--draft-vocab-size sizes --draft-model eagle",
        ),
        (
            ["--int4-group-size", "64"],
            "--int4-group-size (or OPEN_TRAINING_INT4_GROUP_SIZE) has no effect without INT4",
        ),
        (["--int4-qat", "--int4-rollout-only"], "--int4-rollout-only keeps the trainer in full precision"),
        (["--int4-qat", "--fp8-recipe", "blockwise"], "FP8 and INT4 in one run"),
        (["--int4-qat", "--check-weight-update-equal"], "the engine stores packed INT4 codes"),
        (["--fp8-skip-layers", "lm_head"], "--fp8-skip-layers has no effect without FP8"),
        (["--fp8-rollout-only", "--check-weight-update-equal"], "the engine stores FP8 codes"),
        (
            ["--fp8-rollout-only", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"],
            "--fp8-rollout-only with --rollout-num-gpus-per-engine > 1",
        ),
        (["--async-weight-sync", "--max-staleness", "0"], "--max-staleness must be >= 1"),
        (["--partial-rollout"], "add --over-sampling-batch-size above 32"),
        (
            [
                "--partial-rollout",
                "--over-sampling-batch-size",
                "64",
                "--rollout-num-gpus",
                "2",
                "--rollout-num-gpus-per-engine",
                "2",
            ],
            "--partial-rollout with --rollout-num-gpus-per-engine > 1",
        ),
        (
            ["--mask-offpolicy-in-partial-rollout"],
            "--mask-offpolicy-in-partial-rollout needs --partial-rollout",
        ),
        (["--critic-lr", "1e-4"], "--critic-lr sets up the PPO critic; add --advantage-estimator ppo"),
        (["--advantage-estimator", "ppo", "--critic-warmup", "100"], "leaves no rollout of the 100"),
        (
            ["--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 must divide the 1 training ranks",
        ),
        (
            ["--r3-buffer-size", "8"],
            "--r3-buffer-size bounds the routing records kept for replay; add --use-r3",
        ),
        (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt must be >= 2"),
        (["--task", "basic_arithmetic", "--prompt-data", "x.jsonl"], "--task or --prompt-data, not both"),
        (["stray"], "unexpected argument 'stray'"),
        (
            ["--actor-num-gpus-per-node", "3"],
            "--global-batch-size 256 must split evenly over the 3 training ranks",
        ),
        (
            ["--rollout-num-gpus-per-engine", "2"],
            "--rollout-num-gpus (1) must be a multiple of --rollout-num-gpus-per-engine (2)",
        ),
    ],
)
def test_bad_settings_fail_before_any_work(argv, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert fragment in str(e.value)


def test_bad_yaml(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("train:\n  lrate: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key train\.lrate; did you mean --lr"):
        load_config(["--config", str(y)])
    y.write_text("rollout_batch_size: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(["--config", str(y)])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--config", str(tmp_path / "missing.yaml")])


def test_co_evolution_section_needs_an_environment(tmp_path):
    y = tmp_path / "ma.yaml"
    y.write_text("co_evolution:\n  strategy: alternating\n  population_size: 4\n  interval: 5\n")
    with pytest.raises(
        ConfigError, match="--strategy, --population-size, --co-evolution-interval .*--env-path"
    ):
        load_config(["--config", str(y)])
    co = load_config(["--config", str(y), "--env-path", "kuhn_poker"]).co_evolution
    assert (co.strategy, co.population_size, co.co_evolution_interval) == ("alternating", 4, 5)
    y.write_text("co_evolution:\n  env_path: kuhn_poker\n  strategy: random\n")
    with pytest.raises(ConfigError, match="strategy"):
        load_config(["--config", str(y)])


def test_int4_environment_variables_reach_the_config(monkeypatch):
    monkeypatch.setenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "1")
    monkeypatch.setenv("OPEN_TRAINING_INT4_GROUP_SIZE", "32")
    precision = load_config([]).precision
    assert precision.int4_qat and precision.int4_group_size == 32
    with pytest.raises(
        ConfigError, match="--int4-group-size 64 and OPEN_TRAINING_INT4_GROUP_SIZE=32 disagree"
    ):
        load_config(["--int4-group-size", "64"])
    monkeypatch.setenv("OPEN_TRAINING_INT4_GROUP_SIZE", "big")
    with pytest.raises(ConfigError, match="OPEN_TRAINING_INT4_GROUP_SIZE='big': use a positive integer"):
        load_config([])
    monkeypatch.delenv("OPEN_TRAINING_INT4_GROUP_SIZE")
    assert load_config([]).precision.int4_group_size == 128  # the default once INT4 is on
    monkeypatch.delenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG")
    assert not load_config([]).precision.int4_qat


def test_miles_debug_sets_debug_logging(monkeypatch):
    monkeypatch.setenv("MILES_DEBUG", "1")
    assert load_config([]).logging.log_level == "DEBUG"


def test_cli_reports_config_errors_in_one_line(capsys):
    assert main(["train", "--lrr", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "miles train: error: unknown flag --lrr; did you mean --lr?"


def test_every_field_has_help():
    assert all(info.meta["help"] for info in FIELDS.values())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA device"):
        load_config(["--device", "cuda"])


def test_task_config_on_the_command_line_is_json():
    cfg = load_config(
        ["--task", "basic_arithmetic", "--task-config", '{"max_digits": 1, "operators": ["+"]}']
    )
    assert cfg.data.task_config == {"max_digits": 1, "operators": ["+"]}
    with pytest.raises(ConfigError, match="--task-config takes a JSON object"):
        load_config(["--task-config", "max_digits=1"])
    with pytest.raises(ConfigError, match="--task-config expects dict"):
        load_config(["--task-config", "[1, 2]"])  # JSON, but not an object


def test_an_explicit_flag_beats_the_environment_and_bad_switches_are_named(monkeypatch):
    from miles.config import load_config
    from miles.errors import ConfigError

    monkeypatch.setenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "1")
    assert load_config(["--eval-size", "0"]).precision.int4_qat is True
    assert load_config(["--eval-size", "0", "--no-int4-qat"]).precision.int4_qat is False
    monkeypatch.delenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG")
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "2")
    with pytest.raises(ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES='2': use 1 .on. or 0"):
        load_config(["--eval-size", "0", "--fp8-recipe", "blockwise"])


def test_every_example_loads_and_draft_model_none_turns_off_the_yaml_draft():
    """Each config in examples/ is valid as shipped; `--draft-model none` on one that trains an
    EAGLE draft online gives a plain run (no draft, no draft training), not an error."""
    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    assert len(examples) >= 5
    for path in examples:
        made_by = (yaml.safe_load(path.read_text()) or {}).get("prerequisites", {})
        if any(not Path(p).exists() for p in made_by):  # it starts from another command's output
            with pytest.raises(ConfigError, match="does not exist yet") as refused:
                load_config(["--config", str(path)])
            assert any(command in str(refused.value) for command in made_by.values())
        else:
            load_config(["--config", str(path)])
    speculative = str(Path(__file__).parent.parent / "examples" / "speculative_rollout.yaml")
    spec = load_config(["--config", speculative]).speculative
    assert spec.draft_model == "eagle" and spec.online_sft_interval == 2
    spec = load_config(["--config", speculative, "--draft-model", "none"]).speculative
    assert spec.draft_model is None and spec.online_sft_interval == 0


def test_an_example_that_starts_from_another_commands_output_names_that_command(tmp_path, monkeypatch):
    """examples/calculator_tool.yaml starts from the SFT policy a benchmark writes: in a fresh
    clone it is refused before any work, naming the path and the one command that makes it;
    once the path exists it loads."""
    example = Path(__file__).parent.parent / "examples" / "calculator_tool.yaml"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", str(example)])
    assert str(refused.value) == (
        "runs/agents/sft does not exist yet: this configuration starts from it; make it with "
        "`.venv/bin/python benchmarks/agents.py --only sft`"
    )
    (tmp_path / "runs" / "agents" / "sft").mkdir(parents=True)
    assert load_config(["--config", str(example)]).model.model == "runs/agents/sft"


def test_an_on_off_environment_variable_with_another_value_is_refused(monkeypatch):
    """MILES_DEBUG, like the precision variables, is 1 or 0: anything else is named, not taken as on."""
    monkeypatch.setenv("MILES_DEBUG", "banana")
    with pytest.raises(ConfigError, match="MILES_DEBUG='banana': use 1 \\(on\\) or 0 \\(off\\)"):
        load_config(["--num-rollout", "1"])
    monkeypatch.setenv("MILES_DEBUG", "1")
    assert load_config(["--num-rollout", "1"]).logging.log_level == "DEBUG"
    monkeypatch.setenv("MILES_DEBUG", "0")
    assert load_config(["--num-rollout", "1"]).logging.log_level == "INFO"
