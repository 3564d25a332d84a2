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
from miles.errors import MilesError
from miles.rollout.sampling import Request, SamplingParams

log = logging.getLogger("miles")


class EngineClient:
    """What one conversation's code uses: `generate(ids, params, images)` -> the engine's `Sample`
    (prompt + response tokens, response log-probs, routing, versions), the tokenizer, and (a
    vision-language run) `process(text, images)` -> (ids, images) for an image in a turn."""

    def __init__(self, lockstep: Lockstep, index: int, tokenizer, processor=None) -> None:
        self._lockstep, self.index, self.tokenizer, self._processor = lockstep, index, tokenizer, processor

    def generate(
        self, input_ids: Sequence[int], params: SamplingParams | None = None, images: dict | None = None
    ) -> Sample:
        """`images`: the pixels of every image token in `input_ids` (the whole conversation's,
        `miles.data.images.join_images`), as `process` returned them."""
        request = Request(list(input_ids), params or SamplingParams(), images=images)
        return self._lockstep.submit(self.index, request)

    def process(self, text: str, images: list) -> tuple[list[int], dict]:
        """Token ids of `text` with each <image> expanded, and the pixels of `images`: one call."""
        if self._processor is None:
            raise MilesError("client.process: this run's model is not a vision-language model")
        return self._processor(text, images, chat=False)


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
        self.images_seen: list[list[int]] | None = None

    def submit(self, index: int, request: Request) -> Sample:
        box: list = []
        if self.images_seen is not None:
            grid = None if request.images is None else request.images["image_grid_thw"]
            self.images_seen[index].append(0 if grid is None else len(grid))
        with self._cond:  # one conversation may wait with several requests at once (an agent that forks)
            self._waiting.append((index, self._arrivals, request, box))
            self._arrivals += 1
            self._cond.notify_all()
            while not box:
                self._cond.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def run(self, jobs: Sequence[Callable[[EngineClient], Any]], tokenizer, processor=None) -> list[Any]:
        """Each job's return value, or the exception it raised, in order."""
        results: list[Any] = [None] * len(jobs)
        self._live = len(jobs)
        # a vision-language run: each conversation's image count, request by request
        self.images_seen = [[] for _ in jobs] if processor is not None else None

        def one(i: int) -> None:
            try:
                results[i] = jobs[i](EngineClient(self, i, tokenizer, processor))
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
