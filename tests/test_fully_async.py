"""Fully-async rollout: admission control keeps staleness within --max-staleness without
discarding anything (so the trained lengths are the generated ones, where the discard drifts),
every sample is trained once with its tokens' versions, and an uncorrected run is refused."""

from __future__ import annotations

import statistics

import pytest

from miles.config import load_config
from miles.data.prompts import PromptItem
from miles.data.sample import Sample, Status
from miles.errors import ConfigError
from miles.rollout.fully_async import FullyAsyncRollout, trained_staleness
from miles.runtime.feed import staleness_metrics
from tests.conftest import record_trained, small_run_args

SHORT, LONG = 4, 16  # response tokens: half the prompts need 4x longer responses


class _Ids(list):
    @property
    def input_ids(self):
        return list(self)


class _Tokenizer:
    """Prompt "long ..." -> first token 2, else 1: the engine reads a response's target length from it."""

    def __call__(self, text: str) -> _Ids:
        return _Ids([2 if text.startswith("long") else 1, 7])

    def apply_chat_template(self, messages, **_) -> list[int]:
        return list(self(messages[-1]["content"]))


class StepEngine:
    """One token per decoding step for each of `slots` running requests, in the order sent; a
    response ends at its target length (LONG or SHORT, from its first token). Stopped by
    `enough`, the rest are cut off (ABORTED) with their tokens, as the engines do."""

    def __init__(self, slots: int) -> None:
        self.tokenizer, self.slots, self.weight_version = _Tokenizer(), slots, 0

    def generate_until(self, requests, enough):
        live = [(r, list(r.prompt_ids), []) for r in requests]
        finished: list[Sample] = []

        def sample(r, tokens, new, status):
            s = r.sample
            s.tokens, s.response_length, s.status = tokens + new, len(new), status
            s.rollout_log_probs = [-1.0] * len(new)
            s.token_versions, s.weight_versions = [self.weight_version] * len(new), [self.weight_version]
            return s

        while live:
            for _, _, new in live[: self.slots]:
                new.append(5)
            done = [
                x
                for x in live[: self.slots]
                if len(x[1]) - 2 + len(x[2]) >= (LONG if x[1][0] == 2 else SHORT)
            ]
            live = [x for x in live if x not in done]
            finished += [sample(r, t, n, Status.COMPLETED) for r, t, n in done]
            if live and enough(finished):
                return finished, [sample(r, t, n, Status.ABORTED) for r, t, n in live]
        return finished, []


def paced(flags: list[str], steps: int = 24):
    """`steps` training steps of the fully-async schedule on the step engine, the segments run in
    the order the feed runs them (segment s+1 under version s). Returns (generated lengths, trained
    lengths, each trained sample's staleness, groups dropped)."""
    cfg = load_config(
        small_run_args("/tmp/unused", steps)
        + ["--rollout-mode", "fully-async", "--use-tis", "--n-samples-per-prompt", "2"]
        + ["--rollout-batch-size", "4", "--over-sampling-batch-size", "8", "--rollout-max-response-len", "32"]
        + flags
    )
    prompts = iter(PromptItem(f"{'long' if i % 2 else 'short'} {i}") for i in range(10**6))
    engine, schedule = StepEngine(slots=6), FullyAsyncRollout(cfg)
    generated, trained, staleness, seen = [], [], [], {}
    paced.records = []  # each step's metrics as the feed logs them, for the doctor
    schedule.run_segment(engine, lambda k: [next(prompts) for _ in range(k)])
    for step in range(steps):
        generated += schedule.generated
        groups, metrics = schedule.take_batch(step)
        for s in (s for g in groups for s in g):
            assert id(s) not in seen  # trained once (each kept alive, so no id is reused)
            seen[id(s)] = s
            trained.append(s.response_length)
            staleness.append(step - min(s.token_versions))
            assert s.token_versions == sorted(s.token_versions)
        lengths = [s.response_length for g in groups for s in g]
        metrics.update(rollout=step, reward_mean=0.5, train_samples=len(lengths))
        metrics["response_len_mean"] = sum(lengths) / max(1, len(lengths))
        metrics.update(staleness_metrics(trained_staleness(groups, step), cfg.sync.max_staleness))
        paced.records.append(metrics)
        schedule.run_segment(engine, lambda k: [next(prompts) for _ in range(k)])
        engine.weight_version = step + 1  # the version lands where the segment ended
    return generated, trained, staleness, schedule.dropped


def long_share(lengths: list[int]) -> float:
    return sum(n == LONG for n in lengths) / len(lengths)


def test_admission_control_trains_what_was_generated_where_the_discard_drifts_short():
    """Half the prompts need 4x longer responses. Discarding stale groups (--drop-stale) starves
    them: the trained share of long responses falls far below the generated share. Admission
    control trains every group within the bound, so the trained lengths follow the generated ones
    (long share within 0.05; the difference is what was still queued at the end)."""
    generated, trained, staleness, dropped = paced([])
    assert dropped == 0 and max(staleness) <= 2  # the default --max-staleness of fully-async
    assert abs(long_share(trained) - long_share(generated)) <= 0.05
    assert abs(statistics.mean(trained) - statistics.mean(generated)) <= 0.05 * statistics.mean(generated)

    generated_d, trained_d, staleness_d, dropped_d = paced(["--drop-stale"])
    assert dropped_d > 0 and max(staleness_d) <= 2
    assert long_share(trained_d) < long_share(generated_d) - 0.1  # the drift the discard causes
    print(  # the figures docs/distributed.md quotes
        f"admission: long share generated {long_share(generated):.2f} trained {long_share(trained):.2f}; "
        f"discard: generated {long_share(generated_d):.2f} trained {long_share(trained_d):.2f}, {dropped_d} dropped"
    )


def test_a_tighter_bound_still_holds_with_long_responses():
    """--max-staleness 1: every group admitted under version v trains by step v + 1 (segments wait
    for the long ones instead of letting short ones overtake them)."""
    _, trained, staleness, dropped = paced(["--max-staleness", "1"], steps=12)
    assert dropped == 0 and max(staleness) <= 1 and long_share(trained) > 0.3


def test_fully_async_run_trains_each_sample_once_within_the_bound(tmp_path, monkeypatch):
    """A real run on the tiny model: responses cut where a version lands continue under the next
    one (token versions in order), nothing is trained twice or staler than the bound, and the
    pacing metrics are logged."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    trained = record_trained(monkeypatch)
    flags = ["--rollout-mode", "fully-async", "--use-tis", "--over-sampling-batch-size", "8",
             "--rollout-max-response-len", "40", "--rollout-temperature", "1.0", "--eval-size", "0"]  # fmt: skip
    train(load_config(small_run_args(tmp_path, 4) + flags))
    metrics = [m for m in read_metrics(tmp_path) if m["rollout"] >= 0]
    keys = [(s.prompt, s.metadata.get("request_id"), tuple(s.tokens)) for _, g in trained for s in g]
    assert len(set(keys)) == len(keys) and all(m["train_samples"] == 16 for m in metrics)
    cut = [(step, s) for step, samples in trained for s in samples if s.metadata.get("partial_resumes")]
    assert any(s.token_versions[0] < s.token_versions[-1] for _, s in cut)  # some spanned an update
    for _, s in cut:
        assert s.token_versions == sorted(s.token_versions)
        assert len(s.token_versions) == len(s.rollout_log_probs) == s.response_length
    for step, samples in trained:
        assert all(step - min(s.token_versions) <= 2 and max(s.token_versions) <= step for s in samples)
    for m in metrics:
        assert m["staleness_max"] <= 2 and m["staleness_in_flight"] <= 2 and m["staleness_in_queue"] <= 2
        assert m["stale_dropped"] == 0


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--rollout-mode", "fully-async", "--no-use-tis"], "needs an off-policy correction: add --use-tis"),
        (
            [
                "--rollout-mode",
                "fully-async",
                "--use-tis",
                "--partial-rollout",
                "--over-sampling-batch-size",
                "8",
            ],
            "does not combine with --partial-rollout",
        ),
        (["--rollout-mode", "fully-async", "--use-tis", "--async-weight-sync"], "drop --async-weight-sync"),
        (["--drop-stale"], "add --rollout-mode fully-async or --async-weight-sync"),
    ],  # fmt: skip
)
def test_fully_async_refusals_name_the_fix(flags, said):
    with pytest.raises(ConfigError, match=said):
        load_config(small_run_args("/tmp/unused", 1) + flags)


def test_uncorrected_async_is_accepted_only_when_asked(caplog):
    """fully-async with --allow-uncorrected-async runs (said once); one-step --async-weight-sync
    without a correction is warned, not refused."""
    cfg = load_config(
        small_run_args("/tmp/unused", 1)
        + ["--rollout-mode", "fully-async", "--no-use-tis", "--allow-uncorrected-async"]
    )
    assert cfg.sync.max_staleness == 2
    with caplog.at_level("WARNING", logger="miles"):
        load_config(small_run_args("/tmp/unused", 1) + ["--async-weight-sync", "--no-use-tis"])
    assert "--async-weight-sync without an off-policy correction" in caplog.text


def test_the_doctor_names_the_discard_drift_and_an_uncorrected_async_run():
    """The doctor on the two schedules' metrics: the discard's drift is named with the remedy
    (no --drop-stale), admission control is not; an async run without TIS/OPSM is named; a
    run whose samples all sit at the bound is named as paced by it."""
    from miles.doctor.checks import async_uncorrected, length_drift, staleness_at_bound
    from miles.doctor.run import RunRecord

    def run(flags, config):
        paced(flags)
        return RunRecord("run", config, paced.records)

    sync = {"rollout_mode": "fully-async", "max_staleness": 2}
    healthy = run([], {"sync": sync, "algo": {"use_tis": True}})
    drifting = run(["--drop-stale"], {"sync": {**sync, "drop_stale": True}, "algo": {"use_tis": True}})
    assert length_drift(healthy, None) is None
    cause, evidence, remedies = length_drift(drifting, None)
    assert "discarded as stale" in cause and "remove --drop-stale" in remedies[0].why
    assert async_uncorrected(healthy, None) is None
    uncorrected = RunRecord("run", {"sync": sync, "algo": {"use_tis": False}}, healthy.records)
    assert ["--use-tis"] in [r.flags for r in async_uncorrected(uncorrected, None)[2]]
    for share, fires in ((0.25, False), (1.0, True)):  # the step engine's long tails do sit at the bound
        records = [{**r, "staleness_at_bound_frac": share} for r in healthy.records]
        assert (staleness_at_bound(RunRecord("run", healthy.config, records), None) is not None) == fires


def test_a_checkpoint_of_another_mode_starts_the_schedule_at_its_step():
    """Resumed at step 5 from a checkpoint without fully-async state, the first segment admits
    one batch's worth (not the five batches a schedule starting at 0 would owe), and is due by
    step 5 + N."""
    cfg = load_config(small_run_args("/tmp/unused", 8) + ["--rollout-mode", "fully-async", "--use-tis"])
    schedule, engine = FullyAsyncRollout(cfg), StepEngine(slots=64)
    schedule.start_at(5)
    schedule.run_segment(engine, lambda k: [PromptItem(f"short {i}") for i in range(k)])
    assert schedule.admitted - 5 * cfg.rollout.rollout_batch_size == cfg.rollout.rollout_batch_size
    groups, _ = schedule.take_batch(5)
    assert len(groups) == cfg.rollout.rollout_batch_size and schedule.segment == 6


def test_groups_wait_rather_than_drop_to_split_over_ranks():
    """With 3 training ranks and groups of 2, a batch of 4 groups (8 samples) keeps 3 (6 samples);
    the fourth, not yet due, is trained next step, not dropped."""
    cfg = load_config(
        small_run_args("/tmp/unused", 4)
        + ["--rollout-mode", "fully-async", "--use-tis", "--n-samples-per-prompt", "2"]
    )
    schedule, engine = FullyAsyncRollout(cfg), StepEngine(slots=64)
    prompts = iter(PromptItem(f"short {i}") for i in range(100))
    schedule.run_segment(engine, lambda k: [next(prompts) for _ in range(k)])
    first, _ = schedule.take_batch(0, world=3)
    assert [len(g) for g in first] == [2, 2, 2]
    engine.weight_version = 0
    schedule.run_segment(engine, lambda k: [next(prompts) for _ in range(k)])
    second, _ = schedule.take_batch(1, world=3)
    assert first[0][0].prompt == "short 0" and second[0][0].prompt == "short 3"  # the one that waited, first
