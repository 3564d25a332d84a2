"""Tools the policy can call: loaded by `--tool-path`, described to it by a JSON schema, run in
sandboxed worker processes (`miles.rewards.workers` with `Limits`).

A tool is a Python function `module:function` (or `file.py:function`); its schema comes from
its signature and Google-style docstring (HF's `get_json_schema`, what chat templates take as
`tools=`), or from a `schema` attribute holding an OpenAI function schema. Built-in tools:
`calculator` (exact arithmetic) and `python` (runs a program, returns what it printed).

Every way a call can go wrong ends as text the policy reads next (and a counted error kind):
an unknown tool, arguments that do not match the schema, a tool that raises, one that hangs
(killed at --tool-timeout), one that dies or exceeds its limits.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import operator
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.agents.tool_calls import CallError, ToolCall
from miles.errors import ConfigError
from miles.rewards.functions import load_function
from miles.rewards.workers import Limits, RewardFailure, RewardWorkers

MAX_RESULT_CHARS = 2000  # a longer result is cut (the policy's context is the limit that matters)


# ---- built-in tools ----

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. (12 + 3) * 45.

    Args:
        expression: the expression, e.g. "361 * 220"
    """

    def value(node: ast.AST):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


def python(code: str) -> str:
    """Run a Python program and return what it printed (or its error).

    Args:
        code: the program
    """
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the tool's purpose
    except MemoryError:
        return out.getvalue() + "MemoryError: the program exceeded its memory limit"
    except BaseException as e:  # noqa: BLE001 - the program's error is its output
        tail = traceback.format_exception_only(type(e), e)[-1].strip()
        return out.getvalue() + tail
    return out.getvalue()


BUILTIN = {"calculator": "miles.agents.tools:calculator", "python": "miles.agents.tools:python"}


# ---- loading and describing ----


@dataclass
class Tool:
    name: str
    path: str  # module:function, what a worker imports
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {})


def schema_of(func: Callable, path: str) -> dict:
    """The OpenAI function schema of `func`: its `schema` attribute, else from its signature and docstring."""
    declared = getattr(func, "schema", None)
    if declared is not None:
        if not isinstance(declared, dict):
            raise ConfigError(
                f"--tool-path {path}: its `schema` attribute must be a dict (an OpenAI function schema)"
            )
        schema = declared if "function" in declared else {"type": "function", "function": declared}
        if not isinstance(schema["function"].get("name"), str):
            raise ConfigError(f"--tool-path {path}: its schema has no 'name'")
        return schema
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as e:
        raise ConfigError(
            f"--tool-path {path}: cannot describe the tool to the policy ({e}); give it type hints and a docstring "
            "with an Args: section, or a `schema` attribute"
        ) from e


def load_tools(paths: Sequence[str]) -> dict[str, Tool]:
    """Each `--tool-path` (a built-in name or module:function) imported and described, by tool name."""
    tools: dict[str, Tool] = {}
    for spec in paths:
        path = BUILTIN.get(spec, spec)
        func = load_function(
            path, "--tool-path", "module:function, or a built-in tool: " + ", ".join(BUILTIN)
        )
        schema = schema_of(func, spec)
        name = schema["function"]["name"]
        if name in tools:
            raise ConfigError(f"--tool-path {spec}: a second tool named {name!r}; tool names must differ")
        tools[name] = Tool(name, path, schema)
    return tools


_JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


def argument_error(tool: Tool, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's schema (missing, unknown or mistyped), or None."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name} needs the argument(s) {missing}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"{tool.name} takes no argument(s) {unknown}; it takes {sorted(props)}"
    for key, value in arguments.items():
        kind = _JSON_TYPES.get(props[key].get("type", ""))
        if kind is not None and (
            not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
        ):
            return f"{tool.name}: argument {key!r} must be of type {props[key]['type']}, got {value!r}"
    return None


_loaded: dict[str, Callable] = {}


def call_tool(path: str, arguments: dict) -> str:
    """In a worker: the tool's result as text (what the policy will read)."""
    if path not in _loaded:
        _loaded[path] = load_function(path, "--tool-path")
    from miles.rewards.functions import call

    return str(call(functools.partial(_loaded[path], **arguments)))


# ---- running calls ----


@dataclass
class ToolResult:
    text: str  # what the policy reads
    error: str | None = None  # the error kind, None when the call worked
    seconds: float = 0.0


@dataclass
class ToolBox:
    """The run's tools and the sandboxed workers that run their calls."""

    tools: dict[str, Tool]
    timeout: float = 10.0
    limits: Limits = field(default_factory=Limits)
    num_workers: int = 4
    _workers: RewardWorkers | None = None

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def run(self, calls: Sequence[ToolCall | CallError]) -> list[ToolResult]:
        """One result per call, in order; the valid calls run in parallel in the workers."""
        results: list[ToolResult | None] = [None] * len(calls)
        jobs: list[tuple[int, tuple]] = []
        for i, c in enumerate(calls):
            if isinstance(c, CallError):
                results[i] = ToolResult(f"error: {c.message}", c.kind)
            elif c.name not in self.tools:
                results[i] = ToolResult(
                    f"error: there is no tool {c.name!r}; the tools are {sorted(self.tools)}", "unknown_tool"
                )
            elif (why := argument_error(self.tools[c.name], c.arguments)) is not None:
                results[i] = ToolResult(f"error: {why}", "bad_arguments")
            else:
                jobs.append((i, (self.tools[c.name].path, c.arguments)))
        if jobs:
            if self._workers is None:
                self._workers = RewardWorkers(
                    "miles.agents.tools:call_tool", self.num_workers, self.timeout, "--tool-path", "--tool-timeout",
                    self.limits,
                )  # fmt: skip
            start = time.perf_counter()
            outs = self._workers.map([args for _, args in jobs])
            seconds = (time.perf_counter() - start) / len(jobs)
            for (i, _), out in zip(jobs, outs):
                results[i] = as_result(out, seconds)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None


def as_result(out: Any, seconds: float) -> ToolResult:
    if isinstance(out, RewardFailure):
        kind = {"Timeout": "timeout", "WorkerDied": "tool_died", "MemoryError": "memory"}.get(
            out.kind, "tool_raised"
        )
        return ToolResult(f"error: {out.kind}: {out.message}", kind, seconds)
    text = str(out)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"... [{len(text) - MAX_RESULT_CHARS} more characters cut]"
    return ToolResult(text, None, seconds)
