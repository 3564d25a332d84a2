"""Evaluation sets: pass@k against brute force, named sets from --eval-config, and `miles eval`
of a checkpoint equal to the run's own evaluation at that step."""

from __future__ import annotations

import itertools
import json

import pytest

from miles.errors import ConfigError
from miles.rollout.evaluation import ks, load_eval_config, pass_at_k
from tests.conftest import small_run_args


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n):
    for correct in range(n + 1):
        labels = [1] * correct + [0] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(labels, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, correct, k) == pytest.approx(brute, abs=1e-12)
    assert ks(n)[-1] == n and all(k & (k - 1) == 0 or k == n for k in ks(n))


def test_eval_config_errors_name_the_set_and_the_key(tmp_path):
    bad = {
        "eval: {}": "top-level 'eval:' list",
        "eval: [{task: basic_arithmetic}]": "unique 'name'",
        "eval: [{name: a, task: basic_arithmetic, prompt_data: x.jsonl}]": "exactly one of 'task' or 'prompt_data'",
        "eval: [{name: a, task: basic_arithmetic, n_samples: 0}]": "n_samples must be a positive integer",
        "eval: [{name: a, task: basic_arithmetic, temprature: 1}]": "unknown key",
        "eval: [{name: a, task: basic_arithmetic}, {name: a, task: chain_sum}]": "unique 'name'",
    }
    for text, message in bad.items():
        path = tmp_path / "eval.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_eval_config(str(path), 0)


def test_miles_eval_of_a_checkpoint_equals_the_runs_own_evaluation(tmp_path, capsys):
    from miles.cli import main
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    sets = tmp_path / "eval.yaml"
    prompts = tmp_path / "held.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input": f"Calculate {i} + {i}.", "label": str(2 * i)}) + "\n" for i in range(6))
    )
    sets.write_text(
        "eval:\n"
        "  - {name: sums, task: basic_arithmetic, size: 6, n_samples: 4, temperature: 1.0,\n"
        "     task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+']}}\n"
        f"  - {{name: doubles, prompt_data: {prompts}}}\n"
    )
    flags = [*small_run_args(tmp_path / "run", 2), "--eval-config", str(sets), "--n-samples-per-eval-prompt", "3",
             "--save", str(tmp_path / "ckpt")]  # fmt: skip
    train(load_config(flags))
    last = read_metrics(tmp_path / "run")[-1]
    for key in ("eval_pass@1", "eval_pass@2", "eval_pass@3", "eval_sums_pass@4", "eval_sums_accuracy",
                "eval_doubles_accuracy", "eval_doubles_response_len"):  # fmt: skip
        assert key in last, key
    assert last["eval_pass@1"] == pytest.approx(last["eval_accuracy"])  # pass@1 is the mean accuracy
    assert last["eval_pass@1"] <= last["eval_pass@2"] <= last["eval_pass@3"]
    capsys.readouterr()
    assert main(["eval", *flags[: flags.index("--save")], "--load", str(tmp_path / "ckpt")]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone == {k: v for k, v in last.items() if k.startswith("eval_")}
    # on an engine of its own: the same figures under the same steps, and training untouched
    own = [*flags[: flags.index("--save")], "--eval-engine", "own", "--output-dir", str(tmp_path / "own")]
    train(load_config(own))
    shared, beside = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "own")

    def by_step(records, evaluation: bool) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for r in records:
            kept = {
                k: v for k, v in r.items() if k.startswith("eval_") == evaluation and not k.endswith("_time")
            }
            out.setdefault(r["rollout"], {}).update(kept)
        return out

    assert by_step(beside, True) == by_step(shared, True) and len(by_step(shared, True)[1]) > 10
    assert any(set(r) - {"rollout"} <= {k for k in r if k.startswith("eval_")} for r in beside)  # lines apart
    for step, figures in by_step(shared, False).items():
        for key in ("reward_mean", "loss", "grad_norm"):
            if key in figures:
                assert by_step(beside, False)[step][key] == figures[key], (step, key)


def test_an_evaluation_cut_off_by_a_stop_runs_again_on_resume(tmp_path):
    """A checkpoint saved while its step's own-engine evaluation ran records the step as pending;
    a run resumed from it, with that evaluation missing from the metrics, evaluates it again
    from the checkpoint's weights: the same figures."""
    import torch

    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    flags = [*small_run_args(tmp_path / "run", 2), "--eval-engine", "own", "--eval-interval", "1",
             "--save", str(tmp_path / "ckpt")]  # fmt: skip
    train(load_config(flags))
    path = tmp_path / "run" / "metrics.jsonl"
    records = read_metrics(tmp_path / "run")
    (evaluated,) = [r for r in records if r["rollout"] == 1 and "eval_accuracy" in r]
    kept = [r for r in records if r is not evaluated]  # as if stopped before it was logged
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    state_file = tmp_path / "ckpt" / "iter_0000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    state["eval_pending"] = 1
    torch.save(state, state_file)
    train(load_config([*flags, "--load", str(tmp_path / "ckpt")]))
    again = [r for r in read_metrics(tmp_path / "run") if r["rollout"] == 1 and "eval_accuracy" in r]
    assert again == [evaluated]
