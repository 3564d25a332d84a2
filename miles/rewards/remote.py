"""Rewards over HTTP: `--rm-type remote_rm` (a reward server, slime's `--rm-url`) and
`--rm-type llm_judge` (a generative judge behind an OpenAI-compatible server).

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
import re
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
        answer = post_json(self.url, body, self.timeout, self.retries, self.backoff)
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


def post_json(url: str, body: dict, timeout: float, retries: int, backoff: float) -> Any:
    """The JSON answer to a POST, retried on refused connections and 5xx; a RewardFailure else."""
    data = json.dumps(body, default=str).encode()
    late = RewardFailure("Timeout", f"{url}: no answer within --reward-timeout {timeout:g} s")
    failure = RewardFailure("Unreachable", f"{url}: no answer")
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            failure = RewardFailure(f"HTTP{e.code}", f"{url} answered {e.code}: {e.read()[:200]!r}")
            if e.code < 500:
                return failure  # the request itself is wrong: another try gets the same answer
            continue
        except TimeoutError:
            return late
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                return late
            failure = RewardFailure("Unreachable", f"{url}: {reason}")
            continue
        try:
            return json.loads(raw)
        except ValueError:
            return RewardFailure(
                "MalformedReward", f"{url} answered something that is not JSON: {raw[:200]!r}"
            )
    return failure


JUDGE_TEMPLATE = """You are grading an answer to a problem.

Problem:
{prompt}

Reference answer:
{label}

Answer to grade:
{response}

Is the answer correct? Reply with one line: SCORE: 1 if it is correct, SCORE: 0 if it is not."""
_SCORE = re.compile(r"SCORE:\s*([01](?:\.\d+)?)", re.IGNORECASE)


class JudgeReward:
    """`--rm-type llm_judge`: a generative judge behind an OpenAI-compatible server (`--rm-url`, its
    /v1 base; a `miles serve` counts) is asked, with `template`, whether each response is right,
    greedily; the reward is the last `SCORE: x` (0 to 1) of its reply."""

    def __init__(self, url: str, model: str, template: str, timeout: float, concurrency: int = 16,
                 retries: int = 3, backoff: float = 0.5) -> None:  # fmt: skip
        self.url = url.rstrip("/") + (
            "" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions"
        )
        self.model, self.template, self.timeout = model, template, timeout
        self.concurrency, self.retries, self.backoff = concurrency, retries, backoff

    def map(self, samples: Sequence[Sample]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(samples)))) as pool:
            return list(pool.map(self._judge, samples))

    def _judge(self, sample: Sample) -> Any:
        question = self.template.format(prompt=sample.prompt, response=sample.response, label=sample.label)
        body = {"model": self.model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": 64}  # fmt: skip
        answer = post_json(self.url, body, self.timeout, self.retries, self.backoff)
        if isinstance(answer, RewardFailure):
            return answer
        try:
            reply = answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return RewardFailure(
                "MalformedReward", f"{self.url} answered no chat completion: {str(answer)[:200]}"
            )
        scores = _SCORE.findall(reply)
        if not scores:
            return RewardFailure(
                "MalformedVerdict", f"the judge's reply holds no 'SCORE: 0' or 'SCORE: 1': {reply[:200]!r}"
            )
        return min(1.0, float(scores[-1]))
