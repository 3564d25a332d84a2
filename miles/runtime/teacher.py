"""The on-policy distillation teacher (`miles.algo.distill` holds the math): a model loaded beside
the trainer (--opd-teacher-load), or a server that scores the policy's samples (--opd-teacher-url)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles.algo.distill import attach_topk
from miles.data.sample import Sample
from miles.errors import ConfigError, MilesError


def load_teacher(path: str, policy: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The teacher model, frozen; its vocabulary must be the policy's (the same token ids)."""
    from miles.models import registry

    teacher = registry.model_for(path, seed=seed)
    theirs, ours = teacher.lm_head.weight.shape[0], policy.lm_head.weight.shape[0]
    if theirs != ours:
        raise ConfigError(
            f"--opd-teacher-load {path}: its vocabulary has {theirs} tokens, the policy's {ours}; the teacher must "
            "share the policy's tokenizer"
        )
    return teacher.eval().requires_grad_(False)


class TeacherServer:
    """--opd-teacher-url: log pi_T of each sampled response token, from a server's
    meta_info.input_token_logprobs. A teacher that cannot answer stops the run (there is no
    stand-in for its log-probs)."""

    def __init__(self, url: str, temperature: float, topk: int = 0, timeout: float = 600.0, retries: int = 3,
                 concurrency: int = 16) -> None:  # fmt: skip
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/generate") else "/generate")
        self.temperature, self.topk = temperature, topk
        self.timeout, self.retries, self.concurrency = timeout, retries, concurrency

    def logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """log pi_T of each sample's response tokens; with `topk`, also the teacher's top-k per
        response position, set on each sample (`attach_topk`)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(samples)))) as pool:
            return list(pool.map(self._one, samples))

    def _one(self, sample: Sample) -> torch.Tensor:
        from miles.rewards.remote import post_json
        from miles.rewards.workers import RewardFailure

        start = sample.prompt_length  # the first response token's position
        body = {
            "input_ids": list(sample.tokens), "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature, "skip_special_tokens": False},
        }  # fmt: skip
        if self.topk:
            body["top_logprobs_num"] = self.topk
        answer = post_json(self.url, body, self.timeout, self.retries, 0.5)
        if isinstance(answer, RewardFailure):
            raise MilesError(f"--opd-teacher-url {self.url}: {answer}")
        try:
            entries = answer["meta_info"]["input_token_logprobs"]
            values = [e[0] for e in entries[-sample.response_length :]]
            tokens = [e[1] for e in entries[-sample.response_length :]]
        except (KeyError, TypeError, IndexError) as e:
            raise MilesError(
                f"--opd-teacher-url {self.url}: no meta_info.input_token_logprobs in the answer ({e!r}): "
                f"{str(answer)[:200]}"
            ) from e
        if tokens != sample.response_tokens or any(not isinstance(v, (int, float)) for v in values):
            raise MilesError(
                f"--opd-teacher-url {self.url}: the answer's input_token_logprobs do not score this sample's "
                f"{sample.response_length} response tokens (is logprob_start_len supported?)"
            )
        if self.topk:
            self._attach_top(sample, answer)
        return torch.tensor(values, dtype=torch.float32)

    def _attach_top(self, sample: Sample, answer: dict) -> None:
        """meta_info.input_top_logprobs: per position, [log-prob, token id, text] of the teacher's
        likeliest tokens, likeliest first."""
        n, k = sample.response_length, self.topk
        try:
            rows = answer["meta_info"]["input_top_logprobs"][-n:]
            ids = [[int(e[1]) for e in row[:k]] for row in rows]
            values = [[float(e[0]) for e in row[:k]] for row in rows]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise MilesError(
                f"--opd-teacher-url {self.url}: no meta_info.input_top_logprobs for top_logprobs_num {k} in the "
                f"answer ({e!r}): {str(answer)[:200]}"
            ) from e
        if len(rows) != n or any(len(row) != k for row in ids):
            raise MilesError(
                f"--opd-teacher-url {self.url}: input_top_logprobs should hold {k} tokens at each of the "
                f"{n} response positions (--opd-topk-per-position {k} above the vocabulary?)"
            )
        attach_topk(sample, torch.tensor(ids), torch.tensor(values))
