"""The code's shape, checked: imports flow one way between folders, the RL loop stays the
algorithm (small, simple, few dependencies), and the runtime asks protocols, not attributes."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

MILES = ROOT / "miles"


def unit_of(path: Path) -> str:
    """A folder of miles, or a top-level module (miles/cli.py -> 'cli')."""
    rel = path.relative_to(MILES).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def imported_units(path: Path) -> set[str]:
    """The units of miles a file imports (at module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "miles":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("miles.")]
        else:
            continue
        out.update(names)
    return out


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in MILES.rglob("*.py"):
        unit = unit_of(path)
        graph.setdefault(unit, set()).update(u for u in imported_units(path) if u != unit)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_folders_import_each_other_even_through_others():
    assert cycles(unit_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_loop_is_small_and_depends_on_few_modules():
    """loop.py <= 200 lines importing <= 12 miles modules; run_loop <= 50 lines; no function of
    loop.py over McCabe complexity 8 (ruff's C901); Run <= 10 fields."""
    from miles.runtime.loop import Run, run_loop

    source = (MILES / "runtime" / "loop.py").read_text()
    tree = ast.parse(source)
    modules = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("miles")
    }
    assert len(source.splitlines()) <= 200 and len(modules) <= 12, (len(source.splitlines()), sorted(modules))
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == run_loop.__name__]
    assert fn.end_lineno - fn.lineno + 1 <= 50
    assert len(dataclasses.fields(Run)) <= 10
    ruff = [
        sys.executable,
        "-m",
        "ruff",
        "check",
        "--select",
        "C901",
        "--config",
        "lint.mccabe.max-complexity=8",
    ]
    proc = subprocess.run(
        [*ruff, "--no-cache", str(MILES / "runtime" / "loop.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


def test_the_runtime_asks_protocols_not_attributes():
    """No hasattr/getattr probing in miles/runtime: an optional capability is a protocol (isinstance)."""
    found = [
        f"{path.name}:{node.lineno}"
        for path in (MILES / "runtime").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
    ]
    assert found == []
