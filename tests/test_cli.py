"""The `miles` command line: output equals the library's, and bad input is one clear error."""

from __future__ import annotations

import pytest

from miles.cli import main
from miles.models import registry
from tests.conftest import greedy


def test_generate_prints_the_greedy_continuation(capsys):
    assert main(["generate", "--model", "tiny-random", "--prompt", "12+3=", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    model, tok = registry.load("tiny-random")
    new = greedy(model.eval(), tok("12+3=").input_ids, 6, stop_ids=[tok.eos_token_id])
    assert printed == "12+3=" + tok.decode(new, skip_special_tokens=True)


def test_generate_missing_model_is_one_clear_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "no such file or directory" in err and "Traceback" not in err


def test_train_flags_without_a_job_change_the_embedded_default(tmp_path, capsys):
    """`miles train --num-rollout 1 ...` runs the default job with those flags on top (a remedy
    is flags added to a run); a run that names its own job is left as given."""
    import yaml

    from miles.cli import DEFAULT_JOB, default_job_argv

    assert default_job_argv([]) == ["--config", str(DEFAULT_JOB)]
    assert default_job_argv(["--colocate"]) == ["--config", str(DEFAULT_JOB), "--colocate"]
    for own in (
        ["--task", "basic_arithmetic"],
        ["--prompt-data=p.jsonl"],
        ["--config", "run.yaml"],
        ["--help"],
    ):
        assert default_job_argv(own) == own
    args = ["train", "--num-rollout", "1", "--rollout-batch-size", "2", "--eval-size", "0", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path)]) == 0
    assert "with your flags on top" in capsys.readouterr().out
    used = yaml.safe_load((tmp_path / "config.yaml").read_text())
    default = yaml.safe_load(DEFAULT_JOB.read_text())
    assert used["data"]["task"] == default["data"]["task"] == "basic_arithmetic"
    assert used["rollout"]["num_rollout"] == 1 and used["rollout"]["rollout_batch_size"] == 2


def test_retired_decode_flags_are_refused_naming_their_replacement(capsys):
    """The decode-step flags of earlier versions (train's, and generate/serve's own spellings)
    are refused before any work, each naming the flag that replaced it."""
    cases = [
        (["train", "--no-rollout-fused-step"], "--rollout-decode-step"),
        (["train", "--rollout-compile"], "--rollout-decode-step"),
        (["generate", "--prompt", "x", "--fused-step"], "--rollout-decode-step fused"),
        (["serve", "--seed", "3"], "--rollout-seed"),
    ]
    for argv, replacement in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{argv[-1] if argv[-1].startswith('--') else argv[-2]} is no longer a flag" in err
        assert replacement in err and "Traceback" not in err


def test_serve_and_generate_spell_shared_options_as_train_does():
    """An option the commands share has one set of spellings and one help text: generate's and
    serve's flags for a config field are train's."""
    import argparse

    from miles.cli import build_parser
    from miles.config import build_train_parser

    def options(parser: argparse.ArgumentParser) -> dict[str, tuple[tuple[str, ...], str]]:
        return {a.dest: (tuple(a.option_strings), a.help.split(" (default")[0]) for a in parser._actions}

    train = options(build_train_parser())
    commands = build_parser()._subparsers._group_actions[0].choices
    shared = 0
    for name in ("generate", "serve"):
        for dest, (flags, help_text) in options(commands[name]).items():
            if dest in train:
                shared += 1
                assert (flags, help_text) == train[dest], (name, dest)
    assert shared >= 8


def test_version_is_printed(capsys):
    import miles
    from miles.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"miles {miles.__version__}"
