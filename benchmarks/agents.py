"""RL with a tool: the calculator task of examples/calculator_tool.yaml, with and without the tool.

- `sft`: teach the tiny default model the call format with a short `miles sft` on tool-use
  conversations (the question -> a calculator call; the question, the call and its result -> the
  product), few enough steps that it is right only part of the time. Writes runs/agents/sft.
- `rl`: the example's RL run for each seed, and the same run with the tool switched off (the
  policy answers in its head): greedy held-out accuracy at the start and the end, and, over the
  first and the last five steps' samples, the accuracy and the share whose calculator call was
  correct (the expression evaluates to the product).

    .venv/bin/python benchmarks/agents.py                 # sft, then rl (table of docs/agents.md)
    .venv/bin/python benchmarks/agents.py --only rl --seeds 0,1 --rollouts 10
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

from miles.agents.chat import with_tool_system
from miles.agents.tools import calculator, load_tools
from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.rollout.debug_data import load_rollout
from miles.run import train
from miles.train.sft import SFTConfig, run_sft

EXAMPLE = "examples/calculator_tool.yaml"
SFT_DIR = "runs/agents/sft"
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3}


def tool_use_records(n: int, seed: int) -> list[dict]:
    """Two records per problem: the call turn and the answer turn, in the rollout's exact text."""
    import reasoning_gym

    schemas = [t.schema for t in load_tools(["calculator"]).values()]
    out = []
    for entry in reasoning_gym.create_dataset("products", size=n, seed=seed, **TASK):
        a, b = re.search(r"(\d+) \* (\d+)", entry["question"]).groups()
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        call_text = f"<tool_call>{call}</tool_call>"
        messages = with_tool_system([{"role": "user", "content": entry["question"]}], schemas)
        out.append({"input": messages, "label": call_text})
        follow = [
            *messages,
            {"role": "assistant", "content": call_text},
            {"role": "tool", "content": entry["answer"]},
        ]
        out.append({"input": follow, "label": entry["answer"]})
    random.Random(seed).shuffle(out)
    return out


def sft(steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tool_use.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in tool_use_records(5000, seed=99)))
        start = time.perf_counter()
        result = run_sft(
            SFTConfig(
                model="tiny", data=str(data), steps=steps, batch_size=32, lr=1e-3, eval_size=0, save=SFT_DIR
            )
        )
    print(
        f"sft: {result['steps']} steps, loss {result['loss']:.3f}, {time.perf_counter() - start:.0f} s -> {SFT_DIR}"
    )


def correct_call_rate(pattern: str, rollout_id: int) -> float:
    """Share of samples whose first calculator call evaluates to the right product."""
    groups, _ = load_rollout(pattern, rollout_id)
    samples = [s for g in groups for s in g]
    good = 0
    for s in samples:
        calls = s.metadata.get("tool_call_log", [])
        if calls and calls[0].get("name") == "calculator":
            try:
                good += calculator(str(calls[0]["arguments"].get("expression", ""))) == str(s.label)
            except Exception:  # noqa: BLE001 - a wrong expression is a wrong call
                pass
    return good / len(samples)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def rl(seeds: list[int], rollouts: int, lr: float | None) -> None:
    rows = []
    for seed in seeds:
        for tools in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                pattern = str(Path(tmp) / "rollout_{rollout_id}.pt")
                args = ["--config", EXAMPLE, "--seed", str(seed), "--num-rollout", str(rollouts),
                        "--eval-interval", str(rollouts), "--output-dir", tmp, "--no-progress",
                        "--save-debug-rollout-data", pattern] + (["--lr", str(lr)] if lr else [])  # fmt: skip
                cfg = load_config(args)
                if not tools:
                    cfg.agent.tool_path = []
                start = time.perf_counter()
                train(cfg)
                seconds = time.perf_counter() - start
                records = read_metrics(Path(tmp))
                steps = [r for r in records if r["rollout"] >= 0]
                k = min(5, rollouts // 2)  # one step of 16 prompts is noisy: the first and last k steps
                head, tail = range(k), range(rollouts - k, rollouts)
                accuracy = (
                    mean(steps[i]["accuracy"] for i in head),
                    mean(steps[i]["accuracy"] for i in tail),
                )
                calls = None
                if tools:
                    calls = (
                        mean(correct_call_rate(pattern, i) for i in head),
                        mean(correct_call_rate(pattern, i) for i in tail),
                    )
                rows.append(
                    (
                        seed,
                        tools,
                        records[0]["eval_accuracy"],
                        steps[-1]["eval_accuracy"],
                        *accuracy,
                        calls,
                        seconds,
                    )
                )
                print(rows[-1], flush=True)
    print(
        f"\n{rollouts} RL steps of {EXAMPLE}, from {SFT_DIR}; train figures: means over the first and last {k} steps"
    )
    print(
        "| seed | tool | eval accuracy start -> end | train accuracy first -> last steps | correct calls first -> last steps | time |"
    )
    print("|---|---|---|---|---|---|")
    for seed, tools, e0, e1, a0, a1, calls, seconds in rows:
        call = f"{calls[0]:.2f} -> {calls[1]:.2f}" if calls else "-"
        print(
            f"| {seed} | {'calculator' if tools else 'none'} | {e0:.2f} -> {e1:.2f} | {a0:.2f} -> {a1:.2f} | {call} | {seconds:.0f} s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="sft,rl", help="comma-separated parts: sft, rl")
    parser.add_argument(
        "--sft-steps", type=int, default=600, help="SFT steps (few: the policy starts part right)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    parser.add_argument("--rollouts", type=int, default=20, help="RL steps per run")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the example's)")
    args = parser.parse_args()
    parts = args.only.split(",")
    if "sft" in parts:
        sft(args.sft_steps)
    if "rl" in parts:
        rl([int(s) for s in args.seeds.split(",")], args.rollouts, args.lr)


if __name__ == "__main__":
    main()
