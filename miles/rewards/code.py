"""`--rm-type code`: the response's Python program run against the sample's test cases in a
sandbox; the reward is the fraction of tests passed.

A sample's label holds its tests, a JSON list of {"input": stdin, "output": expected stdout}
(a list, or a string of one). The program is the last fenced code block of the response (or the
whole response without one). Each test runs the program in a fresh interpreter (`python -I -S`:
no site-packages, no environment, no user directory) in a fresh temporary directory, which:

- has its CPU seconds, address space and file size bounded (`setrlimit`, set by the child itself
  before the program starts), and a wall-clock timeout after which it is killed;
- refuses, through an audit hook installed before the program runs (PEP 578), opening files
  outside its directory (reading the Python standard library excepted), listing or changing to
  other directories, starting processes (fork, exec, spawn, subprocess), sockets, and ctypes.

This keeps a policy's mistakes (an endless loop, a 10 GB list, a huge file, a fork bomb, a
look at the run's files) from hurting the run. It is not a security boundary against a program
written to escape: an audit hook does not cover C extensions, and the process runs as the
run's user. For untrusted code, point `--custom-rm-path` at a function that sends the program to
a container runtime or a remote sandbox service instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from miles.errors import MilesError

# Runs in the child: limits, then the audit hook, then the program (read before the hook).
BOOTSTRAP = r"""
import os, resource, sys
cpu, memory, file_size = (int(v) for v in sys.argv[2:5])
if cpu:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
if memory:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
if file_size:
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
root = os.path.realpath(os.getcwd())
with open(sys.argv[1]) as f:
    source = f.read()
readable = tuple({os.path.realpath(p) + os.sep for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix)})
refused = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
           "os.killpg", "subprocess.Popen", "pty.spawn", "sys.remote_exec")
writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def inside(path):
    if isinstance(path, int):
        return True  # an open descriptor: it was checked when it was opened
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)


def readable_path(path):
    return not isinstance(path, int) and (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(readable)


def hook(event, args):
    if event in refused or event.startswith(("socket.", "ctypes.", "_posixsubprocess")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        if path is None or inside(path):
            return
        write = (mode is not None and any(c in mode for c in "wax+")) or bool((flags or 0) & writes)
        if not write and readable_path(path):
            return
        raise PermissionError(f"sandbox: {os.fsdecode(path)} is outside the sandbox")
    if event in ("os.listdir", "os.scandir", "glob.glob"):  # the import system lists the standard library
        path = args[0] if args else None
        if path is None or path == "" or inside(path) or readable_path(path):
            return
        raise PermissionError(f"sandbox: {event} on {os.fsdecode(path)} is not allowed")
    if event in ("os.chdir", "os.mkdir", "os.rmdir", "os.remove", "os.rename",
                 "os.chmod", "os.chown", "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"):
        path = args[0] if args else None
        if path is not None and path != "" and not inside(path):
            raise PermissionError(f"sandbox: {event} on {os.fsdecode(path)} is not allowed")


sys.addaudithook(hook)
del hook
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
"""
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n", re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeLimits:
    """What one test run of a program may use."""

    timeout: float = 5.0  # wall-clock seconds (--reward-timeout)
    cpu_seconds: int = 5
    memory_mb: int = 512  # --code-memory-mb
    file_mb: int = 16  # --code-file-mb


def extract_program(response: str) -> str:
    """The last fenced block marked python (else the last fenced block: an unmarked one after
    the program is often its sample output); a block left open (a response cut at its length
    limit) runs to the end; no block: the whole response."""
    blocks = _FENCE.findall(response)
    marked = [code for lang, code in blocks if lang]
    if marked or blocks:
        return marked[-1] if marked else blocks[-1][1]
    opened = _OPEN_FENCE.search(response)
    return response[opened.end() :] if opened else response


def parse_tests(label: Any) -> list[dict[str, str]]:
    """The label's test cases, checked: a list of {"input": str, "output": str}."""
    try:
        tests = json.loads(label) if isinstance(label, str) else label
    except json.JSONDecodeError as e:
        raise MilesError(
            f"--rm-type code: a label must be a JSON list of tests, got {label[:100]!r} ({e})"
        ) from e
    if not isinstance(tests, list) or not tests:
        raise MilesError(
            f"--rm-type code: a label must be a non-empty list of tests, got {str(label)[:100]!r}"
        )
    for t in tests:
        if not (
            isinstance(t, dict) and isinstance(t.get("input", ""), str) and isinstance(t.get("output"), str)
        ):
            raise MilesError(
                f"--rm-type code: a test must be {{'input': str, 'output': str}}, got {str(t)[:100]!r}"
            )
    return tests


def _same_output(got: str, want: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    lines = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


def run_program(program: str, stdin: str, limits: CodeLimits) -> tuple[str, str]:
    """(outcome, stdout) of one run: outcome is ok, error, timeout, memory, file_size, refused or cpu."""
    workdir = tempfile.mkdtemp(prefix="miles-code-")
    try:
        path = os.path.join(workdir, "program.py")
        with open(path, "w") as f:
            f.write(program)
        argv = [sys.executable, "-I", "-S", "-c", BOOTSTRAP, path, str(limits.cpu_seconds),
                str(limits.memory_mb * 1024**2), str(limits.file_mb * 1024**2)]  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONIOENCODING": "utf-8"}
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=workdir, env=env,
                                  timeout=limits.timeout, errors="replace")  # fmt: skip
        except subprocess.TimeoutExpired:
            return "timeout", ""
        if done.returncode == 0:
            return "ok", done.stdout
        return _failure_kind(done.returncode, done.stderr), done.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _failure_kind(returncode: int, stderr: str) -> str:
    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
        return "cpu"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    if "sandbox:" in stderr:
        return "refused"
    return "error"


def code_reward(response: str, label: Any, limits: CodeLimits) -> dict[str, Any]:
    """{"score": fraction of tests passed, "passed", "tests", and a count per failure kind}."""
    tests = parse_tests(label)
    program = extract_program(response)
    outcomes: Counter[str] = Counter()
    passed = 0
    for test in tests:
        outcome, stdout = run_program(program, test.get("input", ""), limits)
        if outcome == "ok" and not _same_output(stdout, test["output"]):
            outcome = "wrong_answer"
        outcomes[outcome] += 1
        passed += outcome == "ok"
    return {"score": passed / len(tests), "passed": passed, "tests": len(tests), **dict(outcomes)}


def code_rewards(samples, limits: CodeLimits, workers: int) -> list[Any]:
    """Every sample's `code_reward`, `workers` programs at a time (each a process of its own)."""
    from miles.rewards.workers import RewardFailure

    def one(sample):
        try:
            return code_reward(sample.response, sample.label, limits)
        except MilesError as e:
            return RewardFailure("BadTests", str(e))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, samples))
