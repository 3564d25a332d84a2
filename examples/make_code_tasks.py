"""Writes examples/code_io.jsonl: small stdin/stdout programming problems for `--rm-type code`.

Each record: {"input": the problem, "label": [{"input": stdin, "output": expected stdout}, ...]}.
The problems are one-liners a small model can learn (arithmetic on read integers, string edits),
with three tests each, drawn from a fixed seed so the file is the same every time.

    .venv/bin/python examples/make_code_tasks.py      # rewrites examples/code_io.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

INSTRUCTION = (
    "Write a Python program that reads from standard input and prints the answer. {task} "
    "Answer with the program only, in a ```python code block."
)


def problems(rng: random.Random):
    """(task text, function from stdin text to stdout text, stdin generator)."""
    k, c = rng.randint(2, 9), rng.randint(1, 20)
    ints = lambda: f"{rng.randint(-50, 99)}\n"  # noqa: E731
    pairs = lambda: f"{rng.randint(-50, 99)} {rng.randint(-50, 99)}\n"  # noqa: E731
    words = lambda: rng.choice(["apple", "river", "stone", "miles", "python", "garden", "rocket"]) + "\n"  # noqa: E731
    yield f"Read an integer n and print n * {k} + {c}.", lambda s: str(int(s) * k + c), ints
    yield f"Read an integer n and print n - {c}.", lambda s: str(int(s) - c), ints
    yield (
        "Read two integers a and b on one line and print their sum.",
        lambda s: str(sum(map(int, s.split()))),
        pairs,
    )
    yield (
        "Read two integers a and b on one line and print the larger one.",
        lambda s: str(max(map(int, s.split()))),
        pairs,
    )
    yield (
        "Read two integers a and b on one line and print a * b.",
        lambda s: str(int(s.split()[0]) * int(s.split()[1])),
        pairs,
    )
    yield "Read a word and print it reversed.", lambda s: s.strip()[::-1], words
    yield "Read a word and print it in upper case.", lambda s: s.strip().upper(), words
    yield "Read a word and print its length.", lambda s: str(len(s.strip())), words
    yield f"Read a word and print it {k} times on one line, without spaces.", lambda s: s.strip() * k, words


def main(count: int = 120, seed: int = 0) -> None:
    rng = random.Random(seed)
    records = []
    while len(records) < count:
        for task, solve, draw in problems(rng):
            stdins = [draw() for _ in range(3)]
            tests = [{"input": x, "output": solve(x) + "\n"} for x in stdins]
            records.append({"input": INSTRUCTION.format(task=task), "label": tests})
    out = Path(__file__).with_name("code_io.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in records[:count]))
    print(f"wrote {count} problems to {out}")


if __name__ == "__main__":
    main()
