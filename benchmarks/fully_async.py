"""Fully-async rollout against the synchronous loop on Ray: 2 engine actors + 1 training actor.

    .venv/bin/python benchmarks/fully_async.py                 # 30 steps each, default job
    .venv/bin/python benchmarks/fully_async.py --extra "--rollout-max-batch-size 16"  # slower rollout

Both runs train the default job's model on the same prompts with the same flags; one adds
`--rollout-mode fully-async` (and its `--max-staleness`). Prints, per run: wall-clock seconds per
trained sample (the steps' wall clock after the first; start-up and evaluations excluded), the
held-out accuracy at each evaluation, the largest staleness trained and in flight, and the ratio.
The runs go one after the other on the same machine, so each has all of its cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.run import train

ROOT = Path(__file__).resolve().parent.parent


def base(steps: int) -> list[str]:
    return [
        "--config", str(ROOT / "miles/assets/default_train.yaml"), "--num-rollout", str(steps),
        "--rollout-num-gpus", "2", "--eval-interval", "10", "--no-progress",
    ]  # fmt: skip


def run(flags: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="miles-fully-async-"))
    train(load_config([*flags, "--output-dir", str(out)]))
    records = read_metrics(out)
    steps = [r for r in records if r["rollout"] >= 0 and "step_time" in r]
    # the steps' wall clock (rollout waited for + training + the sync, which fully-async lands where
    # a segment ends); the first step, which nothing overlaps, and evaluations excluded for both
    wall = sum(r["step_time"] for r in steps[1:])
    samples = sum(r["train_samples"] for r in steps[1:])
    return {
        "per_sample": wall / samples,
        "rollout": sum(r["rollout_time"] for r in steps[1:]) / (len(steps) - 1),
        "train": sum(r["train_time"] for r in steps[1:]) / (len(steps) - 1),
        "evals": [(r["rollout"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r],
        "staleness_max": max(r.get("staleness_max", 0) for r in steps),
        "in_flight_max": max(r.get("staleness_in_flight", 0) for r in steps),
        "queue_max": max(r.get("staleness_in_queue", 0) for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--extra", default="", help="flags added to both runs, space-separated")
    parser.add_argument("--plot", type=Path, help="also draw both runs' held-out accuracy into this PNG")
    args = parser.parse_args()
    flags = base(args.steps) + args.extra.split()
    sync = run(flags)
    fully = run([*flags, "--rollout-mode", "fully-async", "--max-staleness", str(args.max_staleness)])
    for name, r in (("sync", sync), ("fully-async", fully)):
        print(
            f"{name:12s} {r['per_sample'] * 1e3:7.1f} ms/sample  (exposed rollout {r['rollout']:.3f} s/step, "
            f"train+sync {r['train']:.3f} s/step)  staleness max trained {r['staleness_max']}, "
            f"in flight {r['in_flight_max']}, queued {r['queue_max']}"
        )
        print(f"{'':12s} held-out accuracy: " + " ".join(f"{s}:{a:.2f}" for s, a in r["evals"]))
    print(
        f"fully-async / sync, wall-clock per trained sample: {sync['per_sample'] / fully['per_sample']:.2f}x"
    )
    # the most overlap can give here: the trainer (one thread) and the engines' rollout (two
    # threads) share the machine's cores; the step cannot be shorter than training alone, nor than
    # all the CPU work spread over every core
    r, t, cores = sync["rollout"], sync["train"], os.cpu_count() or 1
    bound = (r + t) / max(t, (t + 2 * r) / cores)
    print(f"bound on this machine ({cores} cores, 2 one-thread engines, one-thread trainer): {bound:.2f}x")
    if args.plot:
        plot(args.plot, {"sync": sync, "fully-async": fully})


def plot(path: Path, runs: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in runs.items():
        ax.plot(*zip(*r["evals"]), marker="o", label=name)
    ax.set(xlabel="step", ylabel="held-out accuracy", title="default job on 2 Ray engines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
