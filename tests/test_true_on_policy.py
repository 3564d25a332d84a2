"""--true-on-policy-mode: trainer and engine compute the same bits; what it refuses and why."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.errors import ConfigError
from tests.conftest import small_run_args

TRUE_ON_POLICY = ("--true-on-policy-mode", "--eval-interval", "0")


def trained(records: list[dict]) -> list[dict]:
    return [r for r in records if r["rollout"] >= 0]


def test_true_on_policy_mode_makes_train_and_rollout_logprobs_bitwise_equal(local_run):
    """Every step: the trainer's log-probs equal the engine's exactly (max gap 0.0 over tokens),
    so the TIS weight is exactly 1 and no routing decision differs; the plain run's gap is not 0
    (the metric does see fp32 rounding)."""
    plain = trained(local_run(2))
    assert max(r["train_rollout_logprob_abs_diff_max"] for r in plain) > 0.0
    exact = trained(local_run(2, *TRUE_ON_POLICY))
    assert len(exact) == 2
    for r in exact:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0
        assert r["train_rollout_logprob_abs_diff"] == 0.0
        assert r["tis_mean"] == 1.0 and r["tis_clipfrac"] == 0.0
        assert r["routing_mismatch_frac"] == 0.0
        assert r["grad_norm"] > 0  # it trains


def test_true_on_policy_mode_composes_with_speculative_rollout(tmp_path):
    """Speculative verification scores k + 1 tokens a pass through the same batch-invariant
    forward: still bitwise equal."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    train(load_config(small_run_args(tmp_path, 1) + [*TRUE_ON_POLICY, "--draft-model", "ngram"]))
    (step,) = trained(read_metrics(tmp_path))
    assert step["spec_accept_rate"] > 0  # drafts were verified
    assert step["train_rollout_logprob_abs_diff_max"] == 0.0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--fp8-recipe", "blockwise"], "--fp8-recipe"),
        (["--async-weight-sync"], "--async-weight-sync"),
        (["--partial-rollout", "--over-sampling-batch-size", "8"], "--partial-rollout"),
        (["--moe-capacity-factor", "1.5"], "--moe-capacity-factor"),
        (["--update-weights-interval", "2"], "--update-weights-interval"),
    ],
)
def test_true_on_policy_mode_refuses_what_cannot_be_bitwise(tmp_path, flags, named):
    with pytest.raises(ConfigError, match=f"--true-on-policy-mode with {named}: .+Remove one of them"):
        load_config(small_run_args(tmp_path, 1) + ["--true-on-policy-mode", *flags])


# ---------------- where trainer and engine part: miles doctor --localize-mismatch ----------------

DUMP = ("--mismatch-dump-interval", "1", "--mismatch-dump-samples", "2", "--eval-interval", "0")
PERTURBED = "model.layers.1.self_attn.o_proj.weight"


def dumped_run(tmp_path, monkeypatch, fault: str | None, *flags: str):
    """A 2-rollout run keeping its last rollout for the replay, with a fault planted in the engine:
    `perturbed` loads one projection 5% too large at every weight update, `stale` never applies
    an update (the engine keeps serving the initial weights)."""
    from miles.rollout import engine
    from miles.run import train

    if fault == "perturbed":
        real = engine.apply_named_tensors

        def scaled(model, named):
            return real(model, [(n, t * 1.05 if n == PERTURBED else t) for n, t in named])

        monkeypatch.setattr(engine, "apply_named_tensors", scaled)
    elif fault == "stale":
        monkeypatch.setattr(
            engine.Engine, "update_weights", lambda self, named, version=None, wait=True: None
        )
    train(load_config(small_run_args(tmp_path, 2) + [*DUMP, *flags]))
    return tmp_path


def test_localize_a_healthy_run_finds_nothing_beyond_rounding(tmp_path, monkeypatch):
    from miles.diagnostics.localize import localize

    result = localize(dumped_run(tmp_path, monkeypatch, None))
    assert result.rollout_id == 1 and result.samples == 2
    assert not result.diverged, result
    assert result.engine_step_gap < 1e-4  # the fused step agrees with the general forward
    assert 0 < max(d.rel for d in result.points) < 1e-4  # rounding is seen, and small


def test_localize_names_the_perturbed_layer_and_its_weight(tmp_path, monkeypatch, capsys):
    from miles.cli import main

    run = dumped_run(tmp_path, monkeypatch, "perturbed")
    assert main(["doctor", "--localize-mismatch", str(run)]) == 1
    report = capsys.readouterr().out
    assert "first divergence: model.layers.1.self_attn " in report
    assert "own output differs: model.layers.1.self_attn.o_proj (" in report
    assert "(agree)" in report  # the engine computed what its (wrong) weights say


def test_localize_names_a_stale_weight_sync_at_the_embedding(tmp_path, monkeypatch):
    from miles.diagnostics.localize import localize

    # a full-size first step (no warm-up), so one update moves the embedding well past rounding
    result = localize(dumped_run(tmp_path, monkeypatch, "stale", "--warmup-steps", "0"))
    assert result.first is not None and result.first.point == "model.embed_tokens"
    assert result.parts[0].point == "model.embed_tokens" and result.parts[0].rel > 3 * result.tolerance


def test_localize_names_the_one_layer_that_serves_in_fp8_at_every_position(tmp_path, capsys):
    """--fp8-rollout-only with every decoder layer but one in --fp8-skip-layers (written as the
    guide writes a skip list: quoted, comma-separated): for each of the default model's 4 layer
    positions, the first divergence is that layer's attention, named with its index."""
    from miles.cli import main
    from miles.diagnostics.localize import localize
    from miles.run import train

    for layer in range(4):
        skip = ",".join(f"layers.{i}." for i in range(4) if i != layer)
        run = tmp_path / f"fp8-layer-{layer}"
        flags = ["--fp8-recipe", "blockwise", "--fp8-rollout-only", "--fp8-skip-layers", skip]
        train(load_config(small_run_args(run, 1) + [*DUMP, *flags]))
        result = localize(run)
        assert result.first_layer == layer and result.first.point == f"model.layers.{layer}.self_attn", skip
        assert main(["doctor", "--localize-mismatch", str(run)]) == 1
        assert (
            f"first divergence: model.layers.{layer}.self_attn (decoder layer {layer}; "
            in capsys.readouterr().out
        )


def test_localize_without_a_dump_says_which_flag_keeps_one(tmp_path):
    from miles.diagnostics.localize import localize
    from miles.errors import MilesError

    with pytest.raises(MilesError, match="--mismatch-dump-interval N"):
        localize(tmp_path)
