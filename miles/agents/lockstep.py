"""Many conversations, each driven by its own code on its own thread, batched into one rollout.

A custom generate function or a black-box agent runs one sample per thread and asks for
completions one at a time through an `EngineClient`. The driver waits until every live thread is
either waiting for a completion or finished, then sends all waiting requests to the rollout in
one call (in sample order, so batches do not depend on thread timing) and hands each its
answer. A thread that does slow work of its own (a tool, a web call) holds the others for at most
`patience` seconds before the batch goes without it.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.data.sample import Sample
from miles.rollout.sampling import Request, SamplingParams

log = logging.getLogger("miles")


class EngineClient:
    """What one conversation's code uses: `generate(ids, params)` -> the engine's `Sample`
    (prompt + response tokens, response log-probs, routing, versions), and the tokenizer."""

    def __init__(self, lockstep: Lockstep, index: int, tokenizer) -> None:
        self._lockstep, self.index, self.tokenizer = lockstep, index, tokenizer

    def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None) -> Sample:
        return self._lockstep.submit(self.index, Request(list(input_ids), params or SamplingParams()))


class Lockstep:
    """Runs `jobs[i](client_i)` on threads, batching their requests into `rollout.generate` calls."""

    def __init__(self, rollout, patience: float = 2.0) -> None:
        self.rollout, self.patience = rollout, patience
        self._cond = threading.Condition()
        self._waiting: list[
            tuple[int, int, Request, list]
        ] = []  # (conversation, arrival, request, answer box)
        self._arrivals = 0
        self._live = 0

    def submit(self, index: int, request: Request) -> Sample:
        box: list = []
        with self._cond:  # one conversation may wait with several requests at once (an agent that forks)
            self._waiting.append((index, self._arrivals, request, box))
            self._arrivals += 1
            self._cond.notify_all()
            while not box:
                self._cond.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def run(self, jobs: Sequence[Callable[[EngineClient], Any]], tokenizer) -> list[Any]:
        """Each job's return value, or the exception it raised, in order."""
        results: list[Any] = [None] * len(jobs)
        self._live = len(jobs)

        def one(i: int) -> None:
            try:
                results[i] = jobs[i](EngineClient(self, i, tokenizer))
            except BaseException as e:  # noqa: BLE001 - reported by the caller, per sample
                e.__miles_traceback__ = traceback.format_exc()  # type: ignore[attr-defined]
                results[i] = e
            finally:
                with self._cond:
                    self._live -= 1
                    self._cond.notify_all()

        with ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="miles-agent") as pool:
            for i in range(len(jobs)):
                pool.submit(one, i)
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._live == 0 or bool(self._waiting))
                    if not self._waiting:
                        break
                    # every live thread waiting, or `patience` for one busy with work of its own
                    self._cond.wait_for(lambda: len(self._waiting) >= self._live, timeout=self.patience)
                    batch = sorted(self._waiting, key=lambda w: w[:2])
                    self._waiting = []
                self._answer(batch)
        return results

    def _one(self, request: Request) -> Any:
        try:
            return self.rollout.generate([request])[0]
        except Exception as e:  # noqa: BLE001 - raised in that conversation's thread
            return e

    def _answer(self, batch: list[tuple[int, int, Request, list]]) -> None:
        requests = [request for _, _, request, _ in batch]
        try:
            outs: list[Any] = list(self.rollout.generate(requests))
        except Exception:  # noqa: BLE001 - find whose request it was: only that conversation gets the error
            outs = [self._one(r) for r in requests]
        with self._cond:
            for (*_, box), out in zip(batch, outs):
                box.append(out)
            self._cond.notify_all()
