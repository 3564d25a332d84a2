"""The `miles` command line: output equals the library's, and bad input is one clear error."""

from __future__ import annotations

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
