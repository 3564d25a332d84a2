"""`--rm-type remote_rm`: rewards from an HTTP reward server (slime's `--rm-url`).

With `--rm-batch-size 1` (default) each sample is one POST of slime's payload,
{"prompt", "response", "label", "metadata"}, answered by a number or {"score": number}; with
N > 1, N samples go as {"samples": [...]} and the answer is a list of N rewards (numbers or
{"score": ...}) or {"rewards": [...]}. At most `--rm-max-concurrency` requests are in flight;
each has `--reward-timeout` seconds. A connection error or a 5xx answer is retried
(`--rm-retries`, with backoff); a 4xx, a timeout or an answer that is not a reward fails its
samples (reward 0, counted in reward_failed like a local reward's failure).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.data.sample import Sample
from miles.rewards.workers import RewardFailure


def payload(sample: Sample) -> dict:
    return {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }


class RemoteReward:
    def __init__(
        self, url: str, timeout: float, batch_size: int = 1, concurrency: int = 16, retries: int = 3,
        backoff: float = 0.5,
    ) -> None:  # fmt: skip
        self.url, self.timeout, self.batch_size = url, timeout, batch_size
        self.concurrency, self.retries, self.backoff = concurrency, retries, backoff

    def map(self, samples: Sequence[Sample]) -> list[Any]:
        """One raw result per sample (a value for `as_reward`, or a RewardFailure), in order."""
        batches = [list(samples[i : i + self.batch_size]) for i in range(0, len(samples), self.batch_size)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(batches)))) as pool:
            results = list(pool.map(self._batch, batches))
        return [r for batch in results for r in batch]

    def _batch(self, batch: list[Sample]) -> list[Any]:
        body = payload(batch[0]) if self.batch_size == 1 else {"samples": [payload(s) for s in batch]}
        answer = self._post(body)
        if isinstance(answer, RewardFailure):
            return [answer] * len(batch)
        if self.batch_size == 1:
            return [answer]
        rewards = answer.get("rewards") if isinstance(answer, dict) else answer
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(answer)[:200]
            failure = RewardFailure(
                "MalformedReward", f"{self.url} answered {got} for a batch of {len(batch)}"
            )
            return [failure] * len(batch)
        return rewards

    def _post(self, body: dict) -> Any:
        data = json.dumps(body, default=str).encode()
        failure = RewardFailure("Unreachable", f"{self.url}: no answer")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as e:
                failure = RewardFailure(f"HTTP{e.code}", f"{self.url} answered {e.code}: {e.read()[:200]!r}")
                if e.code < 500:
                    return failure  # the request itself is wrong: another try gets the same answer
                continue
            except TimeoutError:
                return RewardFailure(
                    "Timeout", f"{self.url}: no answer within --reward-timeout {self.timeout:g} s"
                )
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    return RewardFailure(
                        "Timeout", f"{self.url}: no answer within --reward-timeout {self.timeout:g} s"
                    )
                failure = RewardFailure("Unreachable", f"{self.url}: {reason}")
                continue
            try:
                return json.loads(raw)
            except ValueError:
                return RewardFailure(
                    "MalformedReward", f"{self.url} answered something that is not JSON: {raw[:200]!r}"
                )
        return failure
