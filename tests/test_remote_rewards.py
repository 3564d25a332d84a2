"""--rm-type remote_rm against a real reward server process: batching, a slow server (timeout
counted), a 500 then success (retried), malformed answers (named), the run's flags checked."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from miles.config import load_config
from miles.data.sample import Sample, Status
from miles.errors import ConfigError
from miles.rewards.remote import RemoteReward
from miles.rewards.runner import RewardRunner
from tests.conftest import DEFAULT_YAML, ROOT


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reward_server"], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    url = proc.stdout.readline().strip()
    yield url
    proc.kill()
    proc.wait()


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/stats").read())


def sample(prompt: str, response: str, label: str) -> Sample:
    return Sample(prompt=prompt, response=response, label=label)


def test_one_sample_per_request_with_every_failure_contained(server):
    runner = RewardRunner(
        "remote_rm", None, False, 1.0, remote=RemoteReward(server + "/score", 1.0, backoff=0.01)
    )
    samples = [
        sample("a", "4", "4"), sample("b", "5", "4"), sample("slow", "4", "4"), sample("flaky", "4", "4"),
        sample("bad", "4", "4"), sample("notjson", "4", "4"),
    ]  # fmt: skip
    failed = runner.score_groups([samples])
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert failed == 3 and [s.status for s in samples[2:]] == [
        Status.FAILED,
        Status.PENDING,
        Status.FAILED,
        Status.FAILED,
    ]
    assert dict(runner.failure_kinds) == {"Timeout": 1, "NonNumericReward": 1, "MalformedReward": 1}
    assert "--reward-timeout 1" in samples[2].metadata["reward_error"]
    assert "not JSON" in samples[5].metadata["reward_error"]
    assert stats(server)["flaky_tries"] == 2  # the 500, then the retry that succeeded


def test_batches_go_as_one_request_each(server):
    remote = RemoteReward(server + "/batch", 5.0, batch_size=4, concurrency=2)
    runner = RewardRunner("remote_rm", None, False, 5.0, remote=remote)
    samples = [sample(str(i), str(i % 3), "0") for i in range(10)]
    assert runner.score_groups([samples[:5], samples[5:]]) == 0
    assert [s.reward for s in samples] == [float(i % 3 == 0) for i in range(10)]
    assert sorted(stats(server)["batch_sizes"][-3:]) == [2, 4, 4]


def test_unreachable_server_and_wrong_batch_answers_are_named(server):
    dead = RemoteReward("http://127.0.0.1:9/score", 1.0, retries=1, backoff=0.01)
    (failure,) = dead.map([sample("a", "1", "1")])
    assert failure.kind == "Unreachable" and "127.0.0.1:9" in failure.message
    wrong = RemoteReward(server + "/constant", 1.0, batch_size=2)  # one reward, not a list of two
    failures = wrong.map([sample("a", "1", "1"), sample("b", "1", "1")])
    assert {f.kind for f in failures} == {"MalformedReward"} and "batch of 2" in failures[0].message


def test_remote_flags_are_checked():
    base = ["--config", str(DEFAULT_YAML)]
    with pytest.raises(ConfigError, match="needs --rm-url"):
        load_config([*base, "--rm-type", "remote_rm"])
    with pytest.raises(ConfigError, match="server of --rm-type remote_rm or llm_judge"):
        load_config([*base, "--rm-url", "http://127.0.0.1:1/x"])
    with pytest.raises(ConfigError, match="http:// or https://"):
        load_config([*base, "--rm-type", "remote_rm", "--rm-url", "127.0.0.1:1"])
    cfg = load_config(
        [*base, "--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:1/x", "--rm-batch-size", "8"]
    )
    runner = RewardRunner.from_config(cfg, None)
    assert runner.remote.url == "http://127.0.0.1:1/x" and runner.remote.batch_size == 8


def test_an_llm_judge_on_an_openai_compatible_server(server, tmp_path):
    cfg = load_config(["--config", str(DEFAULT_YAML), "--rm-type", "llm_judge", "--rm-url", server + "/v1"])
    runner = RewardRunner.from_config(cfg, None)
    samples = [sample("q1", "4", "4"), sample("q2", "5", "4"), sample("q3", "ramble", "4")]
    assert runner.score_groups([samples]) == 1
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert (
        "MalformedVerdict" in samples[2].metadata["reward_error"]
        and "I cannot tell" in samples[2].metadata["reward_error"]
    )
    with pytest.raises(ConfigError, match="--judge-template"):
        load_config(["--config", str(DEFAULT_YAML), "--judge-template", str(tmp_path / "none.txt")])
