"""Tool calls in the policy's text: parsers by name (`--tool-call-parser`) or by path.

A parser takes the text of one assistant turn and returns what it asked for: `ToolCall`s to run,
or `CallError`s for calls it could not read (the policy is told why, in an observation). The
built-in `hermes` format is the one HF chat templates (Qwen2.5, Hermes, SmolLM3) emit with
`tools=`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.errors import ConfigError


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class CallError:
    """A call the parser could not read; `kind` names the error in the metrics."""

    kind: str
    message: str


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


def hermes(text: str) -> list[ToolCall | CallError]:
    """Every `<tool_call>{json}</tool_call>` block in order (an unclosed last block counts)."""
    out: list[ToolCall | CallError] = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            out.append(CallError("malformed_call", f"the tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(
                CallError("malformed_call", 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
            )
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            out.append(
                CallError("malformed_call", f"the arguments of {call['name']!r} must be a JSON object")
            )
            continue
        out.append(ToolCall(call["name"], arguments))
    return out


PARSERS: dict[str, tuple[Callable[[str], list], str]] = {"hermes": (hermes, HERMES_CLOSE)}


def load_parser(spec: str) -> tuple[Callable[[str], list], list[str]]:
    """(parser, stop strings that end a turn at a finished call) for `--tool-call-parser`: a
    built-in name or `module:function` (whose optional `stop` attribute lists its stop strings)."""
    if spec in PARSERS:
        parser, stop = PARSERS[spec]
        return parser, [stop]
    if ":" not in spec:
        raise ConfigError(
            f"--tool-call-parser {spec!r}: not a built-in parser ({', '.join(PARSERS)}) nor module:function"
        )
    from miles.rewards.functions import load_function

    parser = load_function(spec, "--tool-call-parser")
    return parser, list(getattr(parser, "stop", []))
