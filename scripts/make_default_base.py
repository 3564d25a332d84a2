"""Make the default job's base model (`miles/assets/tiny-moe-base`) from random weights.

The base is fine-tuned on a "chatty teacher": for each arithmetic problem the teacher gives the
bare number (what reasoning-gym's scorer gives full marks to) only `--bare-fraction` of the time,
and otherwise the worked equation ("41 - 7 = 34", partial credit). The model learns to compute
the answers, but greedy decoding mostly picks the teacher's majority format, so its held-out
accuracy starts low while the right answer is one sample away: the situation RL with a verifiable
reward is for (it keeps the competence and fixes the behaviour the imperfect SFT data taught).

The default job's held-out problems are removed from the teacher's data, so the job's held-out
accuracy measures problems the base has never seen.

    .venv/bin/python scripts/make_default_base.py --out miles/assets/tiny-moe-base
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from miles.cli import DEFAULT_JOB
from miles.config.loader import load_config
from miles.data.prompts import task_prompts
from miles.data.run_data import build_data
from miles.train.sft import SFTConfig, run_sft


def teacher_records(size: int, bare_fraction: float, seed: int) -> list[dict]:
    """The teacher's answers to `size` problems of the default job's task, its held-out removed."""
    job = load_config(["--config", str(DEFAULT_JOB)])
    held_out = {str(item.prompt) for item in build_data(job).eval_items}
    items, _ = task_prompts(job.data.task, size, seed, job.data.task_config)
    rng = random.Random(seed)
    records = []
    for item in items:
        if str(item.prompt) in held_out:
            continue
        expression = item.metadata["rg_entry"]["metadata"]["expression"]
        bare = rng.random() < bare_fraction
        records.append(
            {"input": item.prompt, "label": item.label if bare else f"{expression} = {item.label}"}
        )
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the HF checkpoint")
    p.add_argument("--bare-fraction", type=float, default=0.45, help="share of bare-number answers")
    p.add_argument("--size", type=int, default=100_000, help="teacher examples to write")
    p.add_argument("--steps", type=int, default=4000, help="SFT optimizer steps")
    p.add_argument("--seed", type=int, default=1, help="teacher data and SFT seed")
    p.add_argument(
        "--data-out", default="runs/default-base-teacher.jsonl", help="where the teacher data goes"
    )
    args = p.parse_args()
    out = Path(args.out)
    data = Path(args.data_out)
    data.parent.mkdir(parents=True, exist_ok=True)
    records = teacher_records(args.size, args.bare_fraction, args.seed)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} teacher answers to {data}")
    result = run_sft(
        SFTConfig(
            model="tiny-random",
            data=str(data),
            steps=args.steps,
            batch_size=64,
            lr=2e-3,
            seed=args.seed,
            eval_every=500,
            save=str(out),
        )
    )
    print(f"saved {out}: {result}")


if __name__ == "__main__":
    main()
