"""Partial rollout against waiting for every response: rollout wall-clock per step, one run.

    .venv/bin/python benchmarks/partial_rollout.py            # 8 steps each, default job model

Both runs train the same default-job model on the same prompts with sampling at temperature 1 and
up to 96 new tokens, so a few responses run far longer than most (the long tail). Without
--partial-rollout a rollout waits for its slowest response; with it, 2x the groups are in flight
and the rollout stops once --rollout-batch-size of them are complete, carrying the rest over.
Prints each run's rollout seconds per step (mean of the steps after the first), the response
length spread, and the ratio.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.run import train

ROOT = Path(__file__).resolve().parent.parent
BASE = [
    "--config", str(ROOT / "miles/assets/default_train.yaml"), "--num-rollout", "8", "--rollout-batch-size", "16",
    "--n-samples-per-prompt", "8", "--rollout-max-response-len", "96", "--rollout-temperature", "1.0",
    "--eval-size", "0", "--no-progress", "--rollout-max-batch-size", "256",
]  # fmt: skip


def rollout_seconds(flags: list[str]) -> tuple[float, float, float]:
    out = Path(tempfile.mkdtemp())
    train(load_config([*BASE, "--output-dir", str(out), *flags]))
    steps = read_metrics(out)[1:]  # the first rollout starts the carried pool
    return (
        statistics.mean(s["rollout_time"] for s in steps),
        statistics.mean(s["response_len_mean"] for s in steps),
        statistics.mean(s["truncated_frac"] for s in steps),
    )


def main() -> None:
    plain = rollout_seconds([])
    partial = rollout_seconds(["--partial-rollout", "--over-sampling-batch-size", "32"])
    print("| run | rollout s/step | mean response length | truncated |")
    print("|---|---|---|---|")
    for name, (seconds, length, truncated) in (
        ("plain", plain),
        ("--partial-rollout (2x in flight)", partial),
    ):
        print(f"| {name} | {seconds:.3f} | {length:.1f} | {truncated:.1%} |")
    print(f"rollout time, partial / plain: {partial[0] / plain[0]:.2f}x")


if __name__ == "__main__":
    main()
