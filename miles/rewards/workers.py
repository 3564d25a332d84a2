"""Custom reward functions run in worker processes that can be killed.

A reward function is user code: it can hang, call `sys.exit`, or take its interpreter down.
Threads cannot be stopped, so a hung call in a thread pool blocks every later call and keeps the
process alive after the run. Here each worker process imports the function once and runs one
call at a time; a call past the timeout has its worker killed and replaced, a worker that dies
is replaced, and the workers (daemon processes) end with the run.

The function gets a pickled copy of the sample: changes it makes to the sample are not seen by
the run (return the reward; `dict` rewards keep their extra keys under `sample.metadata`).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger("miles")
STARTUP_TIMEOUT = 120.0  # seconds a new worker may take to import the reward function


@dataclass
class RewardFailure:
    """Why one reward call produced no reward."""

    kind: str  # the exception's type name, "Timeout", "WorkerDied", ...
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def _serve(path: str, conn: Connection) -> None:
    """A worker's loop: import the function, then answer one call per message until EOF."""
    from miles.rewards.functions import call, load_function

    try:
        func, import_error = load_function(path, "--custom-rm-path"), None
    except BaseException as e:  # noqa: BLE001 - reported with every call
        func, import_error = None, RewardFailure(type(e).__name__, str(e), traceback.format_exc())
    conn.send(("ready", None))  # the import's time is not part of any call's timeout
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if import_error is not None:
            conn.send(("error", import_error))
            continue
        try:
            reply = ("ok", call(func, *args))
        except SystemExit as e:  # the reward's sys.exit, not the run's
            reply = ("error", RewardFailure("SystemExit", f"the reward function called sys.exit({e.code!r})"))
        except BaseException as e:  # noqa: BLE001 - everything the user code raises is reported
            reply = ("error", RewardFailure(type(e).__name__, str(e) or repr(e), traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send(("error", RewardFailure("BadResult", f"the reward's result cannot be sent back ({e})")))


class _Worker:
    def __init__(self, ctx, path: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(path, child), daemon=True, name="miles-reward")
        self.process.start()
        child.close()
        self.started, self.ready = time.monotonic(), False

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardWorkers:
    """`size` processes that score calls of one `module:function`, each call bounded by `timeout` s."""

    def __init__(self, path: str, size: int, timeout: float) -> None:
        methods = multiprocessing.get_all_start_methods()
        # forkserver: no fork of this (threaded: torch, Ray) process; workers start in ~50 ms
        self.ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(["miles.rewards.workers"])  # a replacement is a bare fork
        self.path, self.size, self.timeout = path, size, timeout
        self.workers: list[_Worker] = []
        self.replaced = 0  # workers killed (timeout) or found dead, and replaced

    def map(self, calls: Sequence[tuple]) -> list[Any]:
        """One result per call, in order: the function's return value or a `RewardFailure`."""
        while len(self.workers) < min(self.size, len(calls)):
            self.workers.append(_Worker(self.ctx, self.path))
        results: list[Any] = [None] * len(calls)
        pending = deque(enumerate(calls))
        idle = [w for w in self.workers if w.ready]
        starting = {w.conn: w for w in self.workers if not w.ready}
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
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
                            f"--custom-rm-path {self.path}: a reward process exited while importing the function "
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
                    results[index] = RewardFailure(
                        "WorkerDied", f"the reward's process exited (exit code {code}) during the call"
                    )
                    self._replace(worker, starting)
            now = time.monotonic()
            for conn, (worker, index, deadline) in list(busy.items()):
                if deadline <= now:  # hung: kill it, the call fails, a fresh worker takes its place
                    del busy[conn]
                    results[index] = RewardFailure(
                        "Timeout",
                        f"no result within --reward-timeout {self.timeout:g} s; its process was killed",
                    )
                    self._replace(worker, starting)
            for worker in list(starting.values()):
                if worker.started + STARTUP_TIMEOUT <= now:
                    raise RuntimeError(
                        f"--custom-rm-path {self.path}: a reward process did not import the function within "
                        f"{STARTUP_TIMEOUT:g} s"
                    )
        return results

    def _replace(self, worker: _Worker, starting: dict[Connection, _Worker]) -> None:
        """Kill `worker`; a fresh one takes its place and joins `starting` until it has imported."""
        worker.kill()
        fresh = _Worker(self.ctx, self.path)
        self.workers[self.workers.index(worker)] = fresh
        starting[fresh.conn] = fresh
        self.replaced += 1

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
