"""On-policy distillation: the default job's base closing its gap to a better teacher.

The teacher is the default job's base after `--teacher-steps` RL steps of the default job (a
better arithmetician than the base). The student starts from the base and trains
`--steps` rollouts of the same job four ways: GRPO on the task reward alone, GRPO plus OPD in
the advantage (`--use-opd --opd-type advantage`), plus OPD in the loss (`--opd-type loss`, k3),
and plus the loss over the teacher's top-16 bins (`--opd-topk-per-position 16`). Printed:
held-out accuracy (greedy, 200 problems) at the start and the end, and the reverse KL to the
teacher (opd_kl, nats per token) at the first and the last step.

    .venv/bin/python benchmarks/distill.py                 # the table of docs/distillation.md
    .venv/bin/python benchmarks/distill.py --teacher-steps 60 --steps 20   # longer
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from miles.config import load_config
from miles.diagnostics.metrics_file import read_metrics
from miles.run import train

DEFAULT = "miles/assets/default_train.yaml"


def run(out: Path, steps: int, *flags: str) -> list[dict]:
    args = ["--config", DEFAULT, "--num-rollout", str(steps), "--eval-interval", str(steps), "--output-dir",
            str(out), "--no-progress", *flags]  # fmt: skip
    train(load_config(args))
    return read_metrics(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher-steps", type=int, default=20, help="RL steps that make the teacher")
    parser.add_argument("--steps", type=int, default=8, help="student RL steps per variant")
    parser.add_argument("--coef", type=float, default=1.0, help="--opd-kl-coef")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        teacher = run(tmp / "teacher", args.teacher_steps, "--save-hf", str(tmp / "teacher_model"))
        print(f"teacher: {args.teacher_steps} steps, held-out accuracy {teacher[-1]['eval_accuracy']:.2f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        rows = []
        for name, flags in (
            ("task reward only", []),
            ("+ OPD (advantage)", ["--use-opd", "--opd-type", "advantage"]),
            ("+ OPD (loss, k3)", ["--use-opd", "--opd-type", "loss", "--kl-loss-type", "k3"]),
            (
                "+ OPD (loss, top-16 bins)",
                ["--use-opd", "--opd-type", "loss", "--opd-topk-per-position", "16"],
            ),
        ):
            if flags:
                flags = [
                    *flags,
                    "--opd-teacher-load",
                    str(tmp / "teacher_model"),
                    "--opd-kl-coef",
                    str(args.coef),
                ]
            else:  # the same teacher forward, weight 0: the KL is measured, not trained on
                flags = ["--use-opd", "--opd-teacher-load", str(tmp / "teacher_model"), "--opd-kl-coef", "0"]
            start = time.perf_counter()
            records = run(tmp / name.replace(" ", "_"), args.steps, *flags)
            steps = [r for r in records if r["rollout"] >= 0]
            rows.append((name, records[0]["eval_accuracy"], steps[-1]["eval_accuracy"], steps[0]["opd_kl"],
                         steps[-1]["opd_kl"], time.perf_counter() - start))  # fmt: skip
            print(rows[-1], flush=True)
    print(f"\nstudent: the default job's base, {args.steps} steps; teacher: the base after {args.teacher_steps} steps "
          f"(held-out accuracy {teacher[-1]['eval_accuracy']:.2f})")  # fmt: skip
    print("| student run | held-out accuracy start -> end | KL to the teacher first -> last step | time |")
    print("|---|---|---|---|")
    for name, a0, a1, k0, k1, seconds in rows:
        print(f"| {name} | {a0:.2f} -> {a1:.2f} | {k0:.3f} -> {k1:.3f} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
