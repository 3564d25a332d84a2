"""The `miles` command line: output equals the library's, and bad input is one clear error."""

from __future__ import annotations

from miles.cli import main
from miles.models import registry
from miles.models.generate import greedy


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
