"""Prompt files, reasoning-gym tasks and rewards: correct values, and clear errors on bad input."""

from __future__ import annotations

import json
import time

import pytest

from miles.data import Sample, Status
from miles.data.prompts import PromptStream, file_prompts, task_prompts
from miles.errors import ConfigError
from miles.rewards import RewardRunner, boxed_answer, exact_match


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_and_parquet_prompts(tmp_path):
    records = [
        {"input": "1+1=", "label": "2", "meta": {"k": 1}},
        {"input": "2+2=", "label": "4", "meta": {"k": 2}},
    ]
    items = file_prompts(write_jsonl(tmp_path / "p.jsonl", records), "input", "label", "meta")
    assert [(i.prompt, i.label, i.metadata) for i in items] == [
        ("1+1=", "2", {"k": 1}),
        ("2+2=", "4", {"k": 2}),
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    assert [i.label for i in file_prompts(tmp_path / "p.parquet", "input", "label", None)] == ["2", "4"]


@pytest.mark.parametrize(
    "content, kwargs, fragment",
    [
        (None, {}, "--prompt-data {path}: no such file"),
        (
            [{"question": "x", "label": "1"}],
            {},
            "record 0: no key 'input' (--input-key); its keys are ['label', 'question']",
        ),
        ([{"input": "x"}], {}, "record 0: no key 'label' (--label-key)"),
        ([], {}, "the file has no records"),
        ("not json\n", {}, "line 1: not valid JSON"),
        (
            [{"input": "x", "label": "1", "meta": 5}],
            {"metadata_key": "meta"},
            "'meta' (--metadata-key) must be an object",
        ),
    ],
)
def test_bad_prompt_files(tmp_path, content, kwargs, fragment):
    path = tmp_path / "data.jsonl"
    if isinstance(content, list):
        write_jsonl(path, content)
    elif isinstance(content, str):
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        file_prompts(path, "input", "label", kwargs.get("metadata_key"))
    assert fragment.format(path=path) in str(e.value)


def test_prompt_stream_resumes_exactly():
    items = [type("I", (), {"prompt": i})() for i in range(7)]
    a = PromptStream(items, seed=3)
    first = [x.prompt for x in a.take(10)]
    b = PromptStream(items, seed=3)
    b.position = 4
    assert [x.prompt for x in b.take(6)] == first[4:]
    assert sorted(first[:7]) == list(range(7))  # each epoch is a permutation


def test_reasoning_gym_task_and_scorer():
    items, dataset = task_prompts(
        "basic_arithmetic", 5, seed=1, config={"min_terms": 2, "max_terms": 2, "allow_parentheses": False}
    )
    runner = RewardRunner("auto", None, False, 5.0, dataset)
    good = Sample(response=items[0].label, metadata=items[0].metadata)
    bad = Sample(response="not a number", metadata=items[0].metadata)
    runner.score_groups([[good, bad]])
    assert good.reward == 1.0 and bad.reward < 1.0
    with pytest.raises(ConfigError, match="not a reasoning-gym task"):
        task_prompts("no_such_task", 5, 1, {})


def test_builtin_rewards():
    assert exact_match(" 42. ", "42") == 1.0 and exact_match("41", "42") == 0.0
    assert boxed_answer("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert boxed_answer("no box 3", "3") == 0.0


def good_reward(sample):
    return 1.0 if sample.response == "yes" else 0.0


async def async_reward(sample):
    return 0.25


def raising_reward(sample):
    raise RuntimeError("boom")


def text_reward(sample):
    return "high"


def slow_reward(sample):
    time.sleep(2)
    return 1.0


def group_reward(samples):
    return [float(i) for i in range(len(samples))]


def _score(path, group=False, timeout=5.0):
    runner = RewardRunner("exact", f"tests.test_data_rewards:{path}", group, timeout)
    samples = [Sample(response="yes"), Sample(response="no")]
    failed = runner.score_groups([samples])
    return samples, failed


def test_custom_rewards_sync_async_group():
    s, failed = _score("good_reward")
    assert [x.reward for x in s] == [1.0, 0.0] and failed == 0
    s, _ = _score("async_reward")
    assert [x.reward for x in s] == [0.25, 0.25]
    s, _ = _score("group_reward", group=True)
    assert [x.reward for x in s] == [0.0, 1.0]


@pytest.mark.parametrize(
    "path, why",
    [("raising_reward", "boom"), ("text_reward", "non-numeric reward 'high'"), ("slow_reward", "Timeout")],
)
def test_failing_reward_marks_sample_failed_and_counts(path, why):
    s, failed = _score(path, timeout=0.5)
    assert failed == 2
    assert all(x.status == Status.FAILED and x.reward == 0.0 and why in x.metadata["reward_error"] for x in s)


def test_bad_reward_path():
    with pytest.raises(ConfigError, match="expected module:function"):
        RewardRunner("exact", "no_colon", False, 1.0)
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        RewardRunner("exact", "no_such_module_xyz:f", False, 1.0)
    with pytest.raises(ConfigError, match="has no 'nope' to call; expected module:function"):
        RewardRunner("exact", "tests.test_data_rewards:nope", False, 1.0)


def test_overlong_penalty_follows_dapos_formula():
    """L_max 20, buffer 8, factor 0.5: nothing up to 12 tokens, then -0.5 x (n - 12) / 8, -0.5 at
    the cap (DAPO eq. 13), and each sample's reward moves by exactly its penalty."""
    from miles.data.sample import Sample
    from miles.rewards.shaping import overlong_penalty, shape_overlong

    want = {0: 0.0, 12: 0.0, 13: -0.0625, 16: -0.25, 20: -0.5}
    assert {n: overlong_penalty(n, 20, 8, 0.5) for n in want} == want
    samples = [Sample(response_length=n, reward=1.0) for n in (5, 16, 20, 20)]
    metrics = shape_overlong(samples, 20, 8, 0.5)
    assert [s.reward for s in samples] == [1.0, 0.75, 0.5, 0.5]
    assert metrics == {"overlong_penalty_mean": -0.3125, "overlong_frac": 0.75}


def test_a_run_whose_responses_reach_the_cap_shows_the_overlong_penalty(tmp_path):
    """The default job's task with a 6-token cap and a 4-token buffer: responses are cut at the cap
    (most of them), each loses up to the factor, and the step's metrics say so; accuracy is the
    task's, before shaping, and a buffer as long as the cap is refused."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.errors import ConfigError
    from miles.run import train
    from tests.conftest import small_run_args

    args = small_run_args(tmp_path, 1) + ["--rollout-max-response-len", "6", "--eval-size", "0"]
    train(load_config(args + ["--overlong-buffer-len", "4", "--overlong-penalty-factor", "0.5"]))
    (step,) = read_metrics(tmp_path)
    assert step["truncated_frac"] > 0 and step["overlong_frac"] >= step["truncated_frac"]
    assert -0.5 <= step["overlong_penalty_mean"] <= -0.5 * step["truncated_frac"]
    with pytest.raises(
        ConfigError, match="--overlong-buffer-len 6 must be below --rollout-max-response-len 6"
    ):
        load_config(args + ["--overlong-buffer-len", "6"])
