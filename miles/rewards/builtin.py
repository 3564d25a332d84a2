"""Built-in rewards: 1.0 for a correct answer, else 0.0."""

from __future__ import annotations

import re
from typing import Any


def _norm(text: Any) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().rstrip(".").strip()


def exact_match(response: str, label: Any) -> float:
    """The response, trimmed, equals the label."""
    return float(_norm(response) == _norm(label))


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(response: str, label: Any) -> float:
    """The last number of the response equals the label as a number: lenient, for instruct models
    that answer in a sentence ("10 + 8 = 18") where an exact match would score nothing."""
    found = NUMBER.findall(str(response).replace(",", ""))
    try:
        return float(bool(found) and float(found[-1]) == float(str(label).replace(",", "")))
    except ValueError:  # a label that is not a number: nothing numeric can match it
        return 0.0


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def boxed_answer(response: str, label: Any) -> float:
    """The last \\boxed{...} of the response equals the label (math style)."""
    got = extract_boxed(response)
    return float(got is not None and _norm(got) == _norm(label))
