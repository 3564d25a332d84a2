"""`option()`: a dataclass field that carries its help text, aliases and availability."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, written as an interval: "[1, inf)", "(0, 1]"."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        left, right = (part.strip() for part in text.strip()[1:-1].split(","))
        return cls(float(left), float(right), text.strip()[0] == "(", text.strip()[-1] == ")")

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if x.is_integer() else repr(x)

        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {num(self.low)}"
        return f"in {'(' if self.low_open else '['}{num(self.low)}, {num(self.high)}{')' if self.high_open else ']'}"


def option(
    default: Any,
    help: str,
    aliases: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    available: bool | str = True,
    bounds: str | None = None,
) -> Any:
    """A config field. `aliases` are extra flag spellings (slime/miles names); `available` is
    True, or a sentence saying why the feature is not built yet (setting it is then an error);
    `bounds` the interval a number must lie in, e.g. "[1, inf)" (checked before any work)."""
    meta = {
        "help": help,
        "aliases": aliases,
        "choices": choices,
        "available": available,
        "bounds": Range.parse(bounds) if bounds else None,
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
