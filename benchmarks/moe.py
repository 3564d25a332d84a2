"""MoE symptoms and their remedies, measured in one run: load imbalance and routing mismatch.

    .venv/bin/python benchmarks/moe.py                  # both tables (~4 min on 2 cores)
    .venv/bin/python benchmarks/moe.py --only load      # or --only routing

Load: the default job's model with its routers collapsed onto experts 0 and 1
(scripts/collapse_router.py) trains with no remedy, with --aux-loss-coef 0.01 and 1.0, and with
--moe-capacity-factor 1.25; each row gives the pooled and per-layer max/mean expert load at the
first and last step, the dropped-slot share and the held-out accuracy at the end.

Routing: trainer vs engine routing on the default job in fp32 and with an FP8 rollout engine, each
without a remedy, with --use-r3 and with --deterministic-expert-routing: the share of top-k choices
that differ, the log-prob gap (mean and max), K3 KL, and the rollout/train seconds per step (the
cost of batch-invariant kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.run import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--config", str(ROOT / "miles/assets/default_train.yaml"), "--rollout-batch-size", "8",
    "--n-samples-per-prompt", "4", "--micro-batch-size", "32", "--no-progress",
]  # fmt: skip


def run(flags: list[str]) -> list[dict]:
    out = Path(tempfile.mkdtemp())
    train(load_config([*SMALL, "--output-dir", str(out), *flags]))
    return read_metrics(out)


def median(steps: list[dict], key: str) -> float:
    values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
    return statistics.median(values) if values else float("nan")


def collapsed_model(strength: float) -> str:
    spec = importlib.util.spec_from_file_location("collapse_router", ROOT / "scripts/collapse_router.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.collapse_router("tiny", tempfile.mkdtemp(), strength)


def load_table(steps: int, strength: float) -> None:
    model = collapsed_model(strength)
    rows = [
        ("no remedy", []),
        ("--aux-loss-coef 0.01", ["--aux-loss-coef", "0.01"]),
        ("--aux-loss-coef 1.0", ["--aux-loss-coef", "1.0"]),
        ("--moe-capacity-factor 1.25", ["--moe-capacity-factor", "1.25"]),
    ]
    flags = [
        "--model",
        model,
        "--num-rollout",
        str(steps),
        "--eval-size",
        "64",
        "--eval-interval",
        str(steps),
    ]
    print(f"\nexpert load, routers collapsed onto experts 0 and 1 (strength {strength:g}), {steps} steps")
    print("| run | max/mean load, first -> last step | per layer, first -> last | dropped | held-out acc |")
    print("|---|---|---|---|---|")
    for name, extra in rows:
        records = run(flags + extra)
        trained = [r for r in records if r["rollout"] >= 0 and "expert_load_max_over_mean" in r]
        first, last = trained[0], trained[-1]
        acc = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
        print(
            f"| {name} | {first['expert_load_max_over_mean']:.2f} -> {last['expert_load_max_over_mean']:.2f} "
            f"| {first['expert_layer_load_max_over_mean']:.2f} -> {last['expert_layer_load_max_over_mean']:.2f} "
            f"| {median(trained, 'expert_dropped_frac'):.1%} | {acc[0]:.3f} -> {acc[-1]:.3f} |"
        )


ROUTING_COLUMNS = [  # (metric, format) in the routing table's column order
    ("routing_mismatch_frac", ".2%"),
    ("routing_mismatch_token_frac", ".2%"),
    ("train_rollout_logprob_abs_diff", ".2e"),
    ("train_rollout_logprob_abs_diff_max", ".2e"),
    ("kl_rollout_train_k3", ".2e"),
    ("rollout_time", ".3f"),
    ("train_time", ".3f"),
]


def routing_table(steps: int) -> None:
    sources = [("fp32", []), ("FP8 rollout", ["--fp8-rollout-only", "--no-use-tis"])]
    remedies = [
        ("none", []),
        ("--use-r3", ["--use-r3"]),
        ("--deterministic-expert-routing", ["--deterministic-expert-routing"]),
    ]
    print(f"\ntrainer vs engine routing, 8 prompts x 4 samples a step, {steps} steps (medians over steps)")
    print(
        "| engine | remedy | choices differing | tokens differing | mean \\|Δlogp\\| | max \\|Δlogp\\| | K3 KL | rollout s | train s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for source, src_flags in sources:
        for remedy, rem_flags in remedies:
            records = run(
                ["--num-rollout", str(steps), "--eval-size", "0", "--no-use-r3", *src_flags, *rem_flags]
            )
            trained = [r for r in records if r["rollout"] >= 0]
            cells = [format(median(trained, key), spec) for key, spec in ROUTING_COLUMNS]
            print(f"| {source} | {remedy} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("load", "routing"))
    parser.add_argument("--load-steps", type=int, default=30)
    parser.add_argument("--routing-steps", type=int, default=5)
    parser.add_argument(
        "--strength", type=float, default=20.0, help="router collapse (scripts/collapse_router.py)"
    )
    args = parser.parse_args()
    if args.only in (None, "load"):
        load_table(args.load_steps, args.strength)
    if args.only in (None, "routing"):
        routing_table(args.routing_steps)


if __name__ == "__main__":
    main()
