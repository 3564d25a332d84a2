"""A multi-turn trajectory as the trainer sees it: the exact token ids the engine consumed and
produced, which of them are the policy's (loss mask 1, engine log-probs) and which are not
(prompt, tool results, the template's turn markers: mask 0), and what happened on the way.

`sample.response` is the text of the policy's last turn (what a reward scores); the
`metadata` keys `turns`, `tool_calls`, `tool_errors` ({kind: count}), `tool_call_log` (each
call's name, arguments, result text and error kind), `tool_seconds`,
`observation_tokens` and `finish` (stop | turn_length | length | max_turns | context |
agent_error) feed the
run's turns/tool/trajectory metrics (`agent_metrics`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.data.sample import Sample, Status

AGENT_ERROR = "agent_error"  # metadata["finish"] of a sample whose generation raised (its group is dropped)


@dataclass
class Trajectory:
    tokens: list[int]
    prompt_length: int
    mask: list[int] = field(default_factory=list)  # per token after the prompt
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routed: Any = None  # the last turn's routing record: every token fed, all but the last
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "result", "error"} per call
    tool_seconds: float = 0.0
    observation_tokens: int = 0
    status: Status = Status.PENDING
    finish: str = ""
    last_text: str = ""

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> Trajectory:
        return cls(list(prompt_ids), len(prompt_ids))

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    def add_turn(self, out: Sample, text: str) -> None:
        """The engine's answer to a request whose prompt was exactly `self.tokens`."""
        if out.tokens[: len(self.tokens)] != self.tokens:
            raise RuntimeError("the engine answered a different prompt than the trajectory so far")
        response = out.response_tokens
        self.tokens += response
        self.mask += [1] * len(response)
        self.log_probs += list(out.rollout_log_probs or [0.0] * len(response))
        version = out.weight_versions[-1] if out.weight_versions else 0
        self.token_versions += list(out.token_versions or [version] * len(response))
        self.weight_versions += [v for v in out.weight_versions if v not in self.weight_versions]
        self.routed = out.rollout_routed_experts
        self.turns += 1
        self.last_text = text

    def add_observation(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not generate (tool results, turn markers): trained on as context only."""
        self.tokens += list(ids)
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.token_versions += [self.token_versions[-1] if self.token_versions else 0] * len(ids)
        self.observation_tokens += len(ids)

    def end(self, status: Status, finish: str) -> None:
        self.status, self.finish = status, finish

    def fill(self, sample: Sample) -> Sample:
        sample.tokens = list(self.tokens)
        sample.response_length = self.response_length
        sample.loss_mask = list(self.mask)
        sample.rollout_log_probs = list(self.log_probs)
        sample.token_versions = list(self.token_versions)
        sample.weight_versions = list(self.weight_versions)
        sample.rollout_routed_experts = self.routed
        sample.status = self.status
        sample.response = self.last_text
        sample.metadata.update(
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=dict(self.tool_errors),
            tool_call_log=list(self.calls),
            tool_seconds=self.tool_seconds,
            observation_tokens=self.observation_tokens,
            finish=self.finish,
        )
        return sample


def agent_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """A rollout's multi-turn metrics (empty when no sample came from a multi-turn rollout): turns,
    tool calls and errors by kind, tool seconds, observation tokens, trajectories cut (any reason),
    cut at --max-turns and cut by the response budget or the context."""
    multi = [s for s in samples if "turns" in s.metadata]
    dropped = [s.metadata["image_turns_dropped"] for s in samples if "image_turns_dropped" in s.metadata]
    images = {"image_turns_dropped_frac": sum(d > 0 for d in dropped) / len(dropped)} if dropped else {}
    if not multi:
        return images
    n = len(multi)
    errors: Counter = Counter()
    for s in multi:
        errors.update(s.metadata["tool_errors"])
    calls = sum(s.metadata["tool_calls"] for s in multi)
    out = {
        "turns_mean": sum(s.metadata["turns"] for s in multi) / n,
        "tool_calls_mean": calls / n,
        "tool_errors": float(sum(errors.values())),
        "tool_error_frac": sum(errors.values()) / calls if calls else 0.0,
        "tool_seconds": sum(s.metadata["tool_seconds"] for s in multi),
        "observation_tokens_mean": sum(s.metadata["observation_tokens"] for s in multi) / n,
        "trajectory_truncated_frac": sum(s.metadata["finish"] not in ("stop", "") for s in multi) / n,
        "trajectory_max_turns_frac": sum(s.metadata["finish"] == "max_turns" for s in multi) / n,
        "trajectory_budget_frac": sum(s.metadata["finish"] in ("length", "context") for s in multi) / n,
    }
    for kind, count in errors.items():
        out[f"tool_errors_{kind}"] = float(count)
    return {**out, **images}
