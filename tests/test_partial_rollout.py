"""Partial rollout: a rollout stops at enough complete groups, cut-off responses continue in the
next one, every sample is trained exactly once, and each token's weight version is recorded."""

from __future__ import annotations

from miles.config import load_config
from miles.data.sample import Sample, Status
from miles.rollout.partial import join
from tests.conftest import record_trained, small_run_args


def test_join_concatenates_the_pieces_and_masks_the_old_part_when_asked():
    old = Sample(
        tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-0.1, -0.2], status=Status.ABORTED
    )
    old.token_versions, old.weight_versions = [0, 0], [0]
    more = Sample(tokens=[1, 2, 3, 4, 5, 6, 7], response_length=3, rollout_log_probs=[-0.3, -0.4, -0.5])
    more.token_versions, more.weight_versions, more.status = [1, 1, 1], [1], Status.COMPLETED
    joined = join(old, more, mask_old=True)
    assert (
        joined.tokens == [1, 2, 3, 4, 5, 6, 7] and joined.prompt_length == 2 and joined.response_length == 5
    )
    assert joined.rollout_log_probs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert joined.token_versions == [0, 0, 1, 1, 1] and joined.weight_versions == [0, 1]
    assert joined.loss_mask == [0, 0, 1, 1, 1] and joined.status == Status.COMPLETED


def check_partial_run(out, monkeypatch, extra: list[str]) -> None:
    """4 steps of partial rollout with 2x in flight: every trained sample is trained once, and a
    resumed sample's tokens carry the versions of the weights that produced them."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    trained = record_trained(monkeypatch)
    flags = ["--partial-rollout", "--over-sampling-batch-size", "8", "--rollout-max-response-len", "40",
             "--rollout-temperature", "1.0", "--eval-size", "0", *extra]  # fmt: skip
    train(load_config(small_run_args(out, 4) + flags))
    metrics = read_metrics(out)
    assert all(m["train_samples"] == 16 for m in metrics)  # rollout_batch_size x n, every step
    everything = [s for _, samples in trained for s in samples]
    keys = [(s.prompt, s.metadata.get("request_id"), tuple(s.tokens)) for s in everything]
    assert len(set(keys)) == len(keys)  # trained exactly once (objects may be copies, from Ray)
    resumed = [(step, s) for step, samples in trained for s in samples if s.metadata.get("partial_resumes")]
    assert resumed and sum(m["partial_resumed_samples"] for m in metrics) > 0
    for step, s in resumed:
        assert len(s.token_versions) == len(s.rollout_log_probs) == s.response_length
        assert s.token_versions == sorted(s.token_versions)  # in order; never older weights later
        # began under older weights; ended by this step (a group completed early waits one step, whole)
        assert s.token_versions[0] < s.token_versions[-1] <= step
        assert s.weight_versions == sorted(set(s.token_versions))
        assert s.rollout_routed_experts.shape[0] == len(s.tokens) - 1  # routing for every position
        assert s.loss_mask == [1] * s.response_length  # corrected by TIS, not masked
    for step, samples in trained:  # every token of a step's samples came from weights up to that step
        assert all(max(s.token_versions) <= step for s in samples)


def test_partial_rollout_trains_each_sample_once_with_its_token_versions(tmp_path, monkeypatch):
    check_partial_run(tmp_path, monkeypatch, [])


def test_partial_rollout_over_two_ray_engines(ray_cluster, tmp_path, monkeypatch):
    """The same on two engine actors, run in lock-step by the driver, which stops both once enough
    groups are done: two runs cut every rollout at the same place, so they are the same run."""
    from miles.diagnostics.metrics_file import read_metrics
    from tests.conftest import comparable

    flags = ["--rollout-num-gpus", "2", "--over-sampling-batch-size", "16"]
    check_partial_run(tmp_path / "a", monkeypatch, flags)
    check_partial_run(tmp_path / "b", monkeypatch, flags)
    first, second = comparable(read_metrics(tmp_path / "a")), comparable(read_metrics(tmp_path / "b"))
    assert first == second


def test_continuation_seeds_are_the_same_in_every_process():
    """Two processes with different hash randomisation draw the same continuation seeds (a string
    in the hashed tuple once made them differ run to run)."""
    import os
    import subprocess
    import sys

    code = "from miles.rollout.partial import continuation_seed; print(continuation_seed(0, 3, 1, 2))"
    seeds = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": h},
        ).stdout
        for h in ("1", "2")
    }
    assert len(seeds) == 1 and seeds.pop().strip().isdigit()
