"""User functions (custom rewards, tools) run in worker processes that can be killed.

A reward function is user code: it can hang, call `sys.exit`, or take its interpreter down.
Threads cannot be stopped, so a hung call in a thread pool blocks every later call and keeps the
process alive after the run. Here each worker process imports the function once and runs one
call at a time; a call past the timeout has its worker killed and replaced, a worker that dies
is replaced, and the workers (daemon processes) end with the run.

The function gets a pickled copy of the sample: changes it makes to the sample are not seen by
the run (return the reward; `dict` rewards keep their extra keys under `sample.metadata`).

With `Limits` (tools), each worker also runs in a fresh temporary directory with a cleared
environment, and each call is bounded in CPU seconds, address space and file size
(`setrlimit`): an allocation past the limit raises MemoryError in the call, a file write past it
fails, a call past its CPU seconds dies (SIGXCPU) and its worker is replaced.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger("miles")
STARTUP_TIMEOUT = 120.0  # seconds a new worker may take to import the reward function


@dataclass(frozen=True)
class Limits:
    """What one call of a sandboxed worker may use (0: no limit)."""

    cpu_seconds: float = 0
    memory_mb: int = 0
    file_mb: int = 0


def _confine(limits: Limits) -> None:
    """A fresh working directory, an environment without the run's variables (tokens, keys),
    and the address-space and file-size limits; the CPU limit is set per call (`_cpu_limit`)."""
    import resource

    os.chdir(tempfile.mkdtemp(prefix="miles-tool-"))
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "TMPDIR": os.getcwd()})
    if limits.memory_mb:  # on top of what the worker already maps (the interpreter, its imports)
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        size = mapped + limits.memory_mb * 1024**2
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    if limits.file_mb:
        size = limits.file_mb * 1024**2
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def _cpu_limit(limits: Limits | None) -> None:
    if limits is not None and limits.cpu_seconds:
        import math
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + limits.cpu_seconds)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))


@dataclass
class RewardFailure:
    """Why one reward call produced no reward."""

    kind: str  # the exception's type name, "Timeout", "WorkerDied", ...
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def _serve(path: str, conn: Connection, flag: str, limits: Limits | None) -> None:
    """A worker's loop: import the function, then answer one call per message until EOF."""
    from miles.rewards.functions import call, load_function

    try:
        func, import_error = load_function(path, flag), None
        if limits is not None:
            _confine(limits)
    except BaseException as e:  # noqa: BLE001 - reported with every call
        func, import_error = None, RewardFailure(type(e).__name__, str(e), traceback.format_exc())
    if not _send(conn, ("ready", None)):  # the import's time is not part of any call's timeout
        return
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if import_error is not None:
            if not _send(conn, ("error", import_error)):
                return
            continue
        try:
            _cpu_limit(limits)
            reply = ("ok", call(func, *args))
        except SystemExit as e:  # the reward's sys.exit, not the run's
            reply = ("error", RewardFailure("SystemExit", f"the reward function called sys.exit({e.code!r})"))
        except BaseException as e:  # noqa: BLE001 - everything the user code raises is reported
            reply = ("error", RewardFailure(type(e).__name__, str(e) or repr(e), traceback.format_exc()))
        try:
            sent = _send(conn, reply)
        except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
            sent = _send(
                conn, ("error", RewardFailure("BadResult", f"the reward's result cannot be sent back ({e})"))
            )
        if not sent:
            return


def _send(conn: Connection, message: tuple) -> bool:
    """Send to the parent; False when it has gone (a pool closed or a call given up), so the worker exits quietly."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False
    return True


class _Worker:
    def __init__(self, ctx, path: str, flag: str, limits: Limits | None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(path, child, flag, limits), daemon=True, name="miles-worker"
        )
        self.process.start()
        child.close()
        self.started, self.ready = time.monotonic(), False

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardWorkers:
    """`size` processes that answer calls of one `module:function`, each call bounded by `timeout` s;
    `flag` and `timeout_flag` name the settings in errors, `limits` sandboxes the workers."""

    def __init__(
        self,
        path: str,
        size: int,
        timeout: float,
        flag: str = "--custom-rm-path",
        timeout_flag: str = "--reward-timeout",
        limits: Limits | None = None,
    ) -> None:
        methods = multiprocessing.get_all_start_methods()
        # forkserver: no fork of this (threaded: torch, Ray) process; workers start in ~50 ms
        self.ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(["miles.rewards.workers"])  # a replacement is a bare fork
        self.path, self.size, self.timeout = path, size, timeout
        self.flag, self.timeout_flag, self.limits = flag, timeout_flag, limits
        self.workers: list[_Worker] = []
        self.replaced = 0  # workers killed (timeout) or found dead, and replaced

    def map(self, calls: Sequence[tuple]) -> list[Any]:
        """One result per call, in order: the function's return value or a `RewardFailure`."""
        while len(self.workers) < min(self.size, len(calls)):
            self.workers.append(_Worker(self.ctx, self.path, self.flag, self.limits))
        results: list[Any] = [None] * len(calls)
        pending = deque(enumerate(calls))
        idle = [w for w in self.workers if w.ready]
        starting = {w.conn: w for w in self.workers if not w.ready}
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        died: set[int] = set()  # calls whose worker died once
        while pending or busy:
            while pending and idle:
                worker = idle.pop()
                index, args = pending.popleft()
                try:
                    worker.conn.send(args)
                except (OSError, ValueError):  # died while idle: replace it and retry the call
                    pending.appendleft((index, args))
                    self._replace(worker, starting)
                    continue
                busy[worker.conn] = (worker, index, time.monotonic() + self.timeout)
            if not busy and not starting:
                break
            deadlines = [d for _, _, d in busy.values()] + [
                w.started + STARTUP_TIMEOUT for w in starting.values()
            ]
            for conn in wait([*busy, *starting], timeout=max(0.0, min(deadlines) - time.monotonic())):
                if conn in starting:
                    worker = starting.pop(conn)
                    try:
                        conn.recv()
                        worker.ready = True
                        idle.append(worker)
                    except (EOFError, OSError):
                        raise RuntimeError(
                            f"{self.flag} {self.path}: a worker process exited while importing the function "
                            f"(exit code {worker.process.exitcode})"
                        ) from None
                    continue
                worker, index, _ = busy.pop(conn)
                try:
                    _, value = conn.recv()
                    results[index] = value
                    idle.append(worker)
                except (EOFError, OSError):
                    worker.process.join(timeout=5)  # its exit code
                    code = worker.process.exitcode
                    if index not in died:  # killed from outside (OOM killer, a fault): once more
                        died.add(index)
                        pending.appendleft((index, calls[index]))
                    else:  # the call itself kills its process
                        results[index] = RewardFailure(
                            "WorkerDied",
                            f"the worker process exited (exit code {code}) during the call, twice",
                        )
                    self._replace(worker, starting)
            now = time.monotonic()
            for conn, (worker, index, deadline) in list(busy.items()):
                if deadline <= now:  # hung: kill it, the call fails, a fresh worker takes its place
                    del busy[conn]
                    results[index] = RewardFailure(
                        "Timeout",
                        f"no result within {self.timeout_flag} {self.timeout:g} s; its process was killed",
                    )
                    self._replace(worker, starting)
            for worker in list(starting.values()):
                if worker.started + STARTUP_TIMEOUT <= now:
                    raise RuntimeError(
                        f"{self.flag} {self.path}: a worker process did not import the function within "
                        f"{STARTUP_TIMEOUT:g} s"
                    )
        return results

    def _replace(self, worker: _Worker, starting: dict[Connection, _Worker]) -> None:
        """Kill `worker`; a fresh one takes its place and joins `starting` until it has imported."""
        worker.kill()
        fresh = _Worker(self.ctx, self.path, self.flag, self.limits)
        self.workers[self.workers.index(worker)] = fresh
        starting[fresh.conn] = fresh
        self.replaced += 1

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
