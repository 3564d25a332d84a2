"""--rm-type code: programs run on their tests in a sandbox; what a policy's program can do wrong
(loop, allocate, write, fork, read the run's files, open sockets) is killed or refused and
counted, and the reward is the fraction of tests passed."""

from __future__ import annotations

import json

import pytest

from miles.config import load_config
from miles.data.sample import Sample
from miles.errors import ConfigError
from miles.rewards.code import CodeLimits, code_reward, extract_program, run_program
from miles.rewards.runner import RewardRunner
from tests.conftest import ROOT

LIMITS = CodeLimits(timeout=3.0, cpu_seconds=1, memory_mb=256, file_mb=1)
TESTS = [
    {"input": "2\n", "output": "7\n"},
    {"input": "5\n", "output": "16\n"},
    {"input": "0\n", "output": "1\n"},
]


@pytest.mark.parametrize(
    "program, outcome",
    [
        ("while True:\n    pass", "cpu"),  # CPU limit (1 s) before the wall clock (3 s)
        ("import time\ntime.sleep(60)", "timeout"),
        ("x = bytearray(10 * 1024**3)", "memory"),
        ("open('big', 'w').write('a' * 8 * 1024**2)", "file_size"),
        ("import os\nos.fork()", "refused"),
        ("import subprocess\nsubprocess.run(['true'])", "refused"),
        ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "refused"),
        (f"print(open({str(ROOT / 'README.md')!r}).read())", "refused"),  # the run's own files
        ("import os\nprint(os.listdir('/'))", "refused"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "refused"),
        ("import ctypes", "refused"),
        ("raise ValueError('bug')", "error"),
    ],
    ids=[
        "loop",
        "sleep",
        "10GB",
        "huge-file",
        "fork",
        "subprocess",
        "multiprocessing",
        "run-files",
        "listdir",
        "socket",
        "ctypes",
        "raises",
    ],  # fmt: skip
)
def test_each_bad_program_is_stopped_and_named(program, outcome):
    assert run_program(program, "", LIMITS)[0] == outcome


def test_a_program_sees_only_its_own_directory_and_the_standard_library():
    program = "import json, os\nopen('note', 'w').write('x')\nprint(json.dumps(sorted(os.listdir('.'))), os.environ.get('HOME') == os.getcwd())"
    outcome, out = run_program(program, "", LIMITS)
    assert outcome == "ok" and out.split() == ['["note",', '"program.py"]', "True"]


def test_the_reward_is_the_fraction_of_tests_passed():
    right = "```python\nn = int(input())\nprint(3 * n + 1)\n```"
    half = "Here:\n```python\nn = int(input())\nprint(3 * n + 1 if n else 0)\n```"  # fails n = 0 only
    assert code_reward(right, TESTS, LIMITS)["score"] == 1.0
    got = code_reward(half, json.dumps(TESTS), LIMITS)  # a label may be the JSON text
    assert got == {"score": pytest.approx(2 / 3), "passed": 2, "tests": 3, "ok": 2, "wrong_answer": 1}
    assert extract_program("a\n```\nx\n```\nb\n```\ny\n```") == "y\n"  # the last fenced block
    assert extract_program("```python\nx\n```\nOutput:\n```\n7\n```") == "x\n"  # the one marked python
    assert extract_program("Sure:\n```python\nprint(1)\nprint(") == "print(1)\nprint("  # cut at the limit


def test_the_runner_scores_a_group_and_keeps_the_counts():
    runner = RewardRunner("code", None, False, 30.0, num_workers=2, code_limits=LIMITS)
    responses = ["```python\nprint(3 * int(input()) + 1)\n```", "```python\nwhile True: pass\n```",
                 "```python\nimport os\nos.system('ls /')\n```"]  # fmt: skip
    group = [Sample(prompt="p", response=r, label=TESTS) for r in responses]
    assert runner.score_groups([group]) == 0  # a program's failure is a reward of 0, not a failed reward
    assert [s.reward for s in group] == [1.0, 0.0, 0.0]
    assert group[1].metadata["reward_info"]["cpu"] == 3 and group[2].metadata["reward_info"]["refused"] == 3
    bad = [Sample(prompt="p", response="x", label="not tests")]
    assert runner.score_groups([bad]) == 1 and "BadTests" in bad[0].metadata["reward_error"]


def test_code_flags_and_the_shipped_example():
    with pytest.raises(ConfigError, match="--code-timeout limits the programs of --rm-type code"):
        load_config(["--code-timeout", "2"])
    cfg = load_config(["--config", str(ROOT / "examples" / "code_reward.yaml")])
    assert cfg.reward.rm_type == "code" and cfg.reward.code_timeout == 3.0
    records = [json.loads(line) for line in (ROOT / "examples" / "code_io.jsonl").read_text().splitlines()]
    assert len(records) == 120 and all(len(r["label"]) == 3 for r in records)
