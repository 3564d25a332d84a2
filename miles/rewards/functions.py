"""User functions by path (`module:function` or `file.py:function`), called sync or async."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.errors import ConfigError


def load_function(path: str, flag: str, what: str = "module:function, e.g. my_rewards:score") -> Callable:
    """Import `module:function` (a module name, or a .py file path before the colon); `what`
    says in an error what the flag takes."""
    if ":" not in path:
        raise ConfigError(f"{flag} {path!r}: expected {what}")
    module_name, func_name = path.rsplit(":", 1)
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise ConfigError(f"{flag} {path!r}: no such file {file}")
            spec = importlib.util.spec_from_file_location(file.stem, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[file.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{flag} {path!r}: cannot import {module_name!r} ({e})") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{flag} {path!r}: {module_name} has no {func_name!r} to call; expected {what}")
    return func


def call(func: Callable, *args: Any) -> Any:
    """`func(*args)`, awaited when it is a coroutine function."""
    result = func(*args)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable
