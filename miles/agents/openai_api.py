"""The OpenAI chat/completions API over a rollout: request parsing, responses, and the
token-exact session a black-box agent's requests are assembled into.

Responses carry, besides the standard fields, the exact `prompt_token_ids` and each choice's
`token_ids` (vLLM's spelling), so a client can check what was generated. A `ChatSession`
keeps every completion it answered: when a request's messages continue an earlier completion's
messages and its reply (as the client sends it back), the prompt is that completion's exact
tokens plus only the template's text for the new messages. A request that does not continue
one (the agent edited or dropped history) starts a new branch: one trajectory per branch.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles.agents.chat import bridge, encode, render
from miles.agents.tool_calls import ToolCall, hermes
from miles.data.sample import Sample
from miles.data.trajectory import Trajectory
from miles.errors import MilesError
from miles.rollout.sampling import SamplingParams


class APIError(MilesError):
    """A request the API refuses (HTTP 400), with a message naming the field."""


_CHAT_KEYS = {
    "model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n",
    "logprobs", "top_logprobs", "tools", "tool_choice", "stream", "user", "parallel_tool_calls",
    "frequency_penalty", "presence_penalty", "top_k", "extra_body",
}  # fmt: skip
_COMPLETION_KEYS = {"model", "prompt", "temperature", "top_p", "max_tokens", "stop", "seed", "n", "logprobs",
                    "stream", "user", "echo", "top_k"}  # fmt: skip


def sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    if body.get("stream"):
        raise APIError("stream=true is not supported; ask without streaming")
    if body.get("n", 1) != 1:
        raise APIError("n must be 1 (ask again for more completions)")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key):
            raise APIError(
                f"{key} is not supported (it would change the sampling distribution the trainer assumes)"
            )
    stop = body.get("stop") or []
    kwargs: dict[str, Any] = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", -1),
        "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens,
        "stop": [stop] if isinstance(stop, str) else stop,
    }
    if body.get("seed") is not None:
        kwargs["seed"] = body["seed"]
    for key, kind in (
        ("temperature", (int, float)),
        ("top_p", (int, float)),
        ("top_k", int),
        ("max_new_tokens", int),
    ):
        if not isinstance(kwargs[key], kind) or isinstance(kwargs[key], bool):
            raise APIError(f"{key} has the wrong type: {kwargs[key]!r}")
    if not isinstance(kwargs["stop"], list) or not all(isinstance(s, str) for s in kwargs["stop"]):
        raise APIError("stop must be a string or a list of strings")
    try:
        return SamplingParams(**kwargs)
    except (MilesError, TypeError) as e:
        raise APIError(str(e)) from e


def chat_request(body: Any) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a /v1/chat/completions body, checked."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = set(body) - _CHAT_KEYS
    if unknown:
        raise APIError(f"unsupported field(s) {sorted(unknown)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError("each message must be an object with a 'role'")
        if not isinstance(m.get("content") or "", str):
            raise APIError("message content must be text (content parts are not supported)")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise APIError("'tools' must be a list of function schemas")
    return [normalize(m) for m in messages], tools or None


def normalize(message: dict) -> dict:
    """A message as the chat template gets it: content as text, tool calls with parsed arguments."""
    out = {
        k: v for k, v in message.items() if v is not None and k in ("role", "content", "name", "tool_call_id")
    }
    out["content"] = message.get("content") or ""
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
            for c in calls
        ]
    return out


def _arguments(call: dict) -> Any:
    raw = call["function"].get("arguments", {})
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content before the first call, OpenAI tool_calls) of an assistant turn in the Hermes format."""
    calls = [c for c in hermes(text) if isinstance(c, ToolCall)]
    if not calls:
        return text, []
    content = text[: text.find("<tool_call>")].rstrip()
    return content, [
        {
            "id": f"call_{uuid.uuid4().hex[:12]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def finish_reason(sample: Sample, has_calls: bool) -> str:
    if sample.status.value == "truncated":
        return "length"
    return "tool_calls" if has_calls else "stop"


def chat_response(sample: Sample, tokenizer, model: str, logprobs: bool) -> dict:
    text = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    content, calls = _tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason(sample, bool(calls)),
        "token_ids": sample.response_tokens,
        "logprobs": _logprobs(sample, tokenizer) if logprobs else None,
    }
    return _envelope("chat.completion", model, sample, choice)


def completion_response(sample: Sample, tokenizer, model: str, logprobs: bool) -> dict:
    choice: dict[str, Any] = {
        "index": 0,
        "text": tokenizer.decode(sample.response_tokens, skip_special_tokens=True),
        "finish_reason": finish_reason(sample, False),
        "token_ids": sample.response_tokens,
        "logprobs": None,
    }
    if logprobs:
        tokens = [tokenizer.decode([t]) for t in sample.response_tokens]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(sample.rollout_log_probs or [])}
    return _envelope("text_completion", model, sample, choice)


def _logprobs(sample: Sample, tokenizer) -> dict:
    return {
        "content": [
            {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(sample.response_tokens, sample.rollout_log_probs or [])
        ]
    }


def _envelope(kind: str, model: str, sample: Sample, choice: dict) -> dict:
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:16]}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": sample.prompt_length,
            "completion_tokens": sample.response_length,
            "total_tokens": len(sample.tokens),
        },
        "prompt_token_ids": sample.tokens[: sample.prompt_length],
    }


def completion_request(body: Any, tokenizer) -> list[int]:
    """The prompt ids of a /v1/completions body (text, or a list of token ids)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = set(body) - _COMPLETION_KEYS
    if unknown:
        raise APIError(f"unsupported field(s) {sorted(unknown)}")
    if body.get("echo"):
        raise APIError("echo is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return encode(tokenizer, prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise APIError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)")


# ---- sessions: a black-box agent's completions as exact trajectories ----


@dataclass
class Completion:
    messages: list[dict]
    tools: list[dict] | None
    sample: Sample  # the engine's: prompt ids + response ids, log-probs, routing
    reply: dict  # the assistant message as returned, normalized
    branch: int
    previous: Completion | None = None  # the completion this one continues (same branch)


@dataclass
class ChatSession:
    tokenizer: Any
    completions: list[Completion] = field(default_factory=list)
    branches: int = 0

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The exact prompt ids for `messages`: an earlier completion's tokens when they continue it."""
        for c in reversed(self.completions):
            n = len(c.messages)
            if (
                c.tools == tools
                and len(messages) > n + 1
                and messages[:n] == c.messages
                and same_reply(messages[n], c.reply)
            ):
                tokens = c.sample.tokens
                special = tokens[-1] in set(self.tokenizer.all_special_ids)
                tail = self.tokenizer.decode(tokens[-1:], skip_special_tokens=False) if special else ""
                text = bridge(self.tokenizer, c.messages, messages[n + 1 :], tools, tail)
                return list(tokens) + encode(self.tokenizer, text)
        return encode(self.tokenizer, render(self.tokenizer, messages, tools, generation_prompt=True))

    def record(self, messages: list[dict] | None, tools: list[dict] | None, sample: Sample) -> None:
        """Keep a completion; it continues the latest one whose tokens its prompt starts with."""
        text = self.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
        content, calls = _tool_calls(text)
        reply = normalize({"role": "assistant", "content": content, "tool_calls": calls or None})
        prompt = sample.tokens[: sample.prompt_length]
        previous = next(
            (c for c in reversed(self.completions) if prompt[: len(c.sample.tokens)] == c.sample.tokens),
            None,
        )
        if previous is None:
            branch, self.branches = self.branches, self.branches + 1
        else:
            branch = previous.branch
        self.completions.append(Completion(messages or [], tools, sample, reply, branch, previous))

    def branch_ends(self) -> list[Completion]:
        """The last completion of each branch, in branch order (a continued completion is not an end)."""
        continued = {id(c.previous) for c in self.completions if c.previous is not None}
        return [c for c in self.completions if id(c) not in continued]


def same_reply(sent: dict, reply: dict) -> bool:
    return (
        sent.get("role") == "assistant"
        and sent.get("content", "").strip() == reply["content"].strip()
        and [(c["function"]["name"], c["function"]["arguments"]) for c in sent.get("tool_calls", [])]
        == [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])]
    )


def trajectory(end: Completion) -> Trajectory:
    """A branch as one trajectory: each completion's response (mask 1) and, between them, the
    prompt tokens the next request added (mask 0)."""
    chain: list[Completion] = []
    c: Completion | None = end
    while c is not None:
        chain.append(c)
        c = c.previous
    first = chain[-1].sample
    t = Trajectory.start(first.tokens[: first.prompt_length])
    for c in reversed(chain):
        t.add_observation(c.sample.tokens[len(t.tokens) : c.sample.prompt_length])
        t.add_turn(c.sample, c.reply["content"])
    t.end(end.sample.status, "stop" if end.sample.status.value == "completed" else "length")
    return t
