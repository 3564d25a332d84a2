"""Time per GRPO step: TRL's GRPOTrainer and `miles train`, same model, task, batch and lengths.

    .venv/bin/python benchmarks/grpo_step_vs_trl.py [--model tiny|smollm2] [--steps 6] [--rounds 3]

TRL (with `datasets`) installs on first use into the peers' cache folder (benchmarks/peers.py),
not into the project. Both sides train the same weights on the same reasoning-gym
basic_arithmetic prompts in the chat template, the same number of prompts x samples per step,
the same maximum of new tokens, temperature 1, AdamW at the same LR, no reference model
(beta 0), one optimizer step per rollout, every activation kept (TRL's GRPOConfig would
checkpoint them by default, recomputing the forward in backward), the same reward function:

- tiny: the shipped tiny Qwen3-MoE base model (miles/assets/tiny-moe-base, which transformers
  loads as Qwen3MoeForCausalLM), the default job's task; 32 prompts x 8 samples, 8 new tokens;
- smollm2: SmolLM2-135M-Instruct (the shipped GGUF, saved as an HF checkpoint for TRL), the task of
  examples/smollm2_grpo.yaml with its lenient last-number reward; 8 prompts x 8 samples, 64 new
  tokens.

The machine's speed drifts over tens of seconds (a shared VM), so the sides alternate in
`--rounds` rounds (miles, then TRL, each from a fresh start), and each side's median is taken over
every round: both see the same mix of fast and slow phases. The first step of each side in each
round is warm-up and not counted; the median of the rest is printed, with
the share of samples whose advantage is 0 (a group whose rewards were all equal), which neither
side's gradient gets anything from and which miles does not run (`--skip-zero-advantage`);
`--miles-args=--no-skip-zero-advantage` times miles running them as TRL does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from peers import peer

from miles.rewards.builtin import exact_match, last_number

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Setup:
    config: Path  # the miles job whose task and model both sides use
    prompts: int
    group: int
    new_tokens: int
    lr: float
    reward: object  # (response, label) -> float, on both sides

    @property
    def job(self) -> dict:
        return yaml.safe_load(self.config.read_text())


SETUPS = {
    "tiny": Setup(ROOT / "miles" / "assets" / "default_train.yaml", 32, 8, 8, 2e-4, exact_match),
    "smollm2": Setup(ROOT / "examples" / "smollm2_grpo.yaml", 8, 8, 64, 1e-5, last_number),
}


def hf_checkpoint(model_name: str) -> Path:
    """The model both sides start from, as a Hugging Face checkpoint folder."""
    if model_name == "tiny":
        return ROOT / "miles" / "assets" / "tiny-moe-base"
    from miles.models import registry, save_model

    out = Path(tempfile.mkdtemp())
    policy, tokenizer = registry.load(model_name)
    save_model(policy, out, tokenizer=tokenizer)
    return out


def time_trl(setup: Setup, checkpoint: Path, steps: int) -> list[float]:
    datasets = peer("datasets", ["trl", "datasets", "dill", "multiprocess", "pandas"], folder="trl")
    trl = peer("trl", ["trl"], folder="trl")
    if trl is None or datasets is None:
        raise SystemExit("TRL cannot be installed here (see above)")
    import reasoning_gym
    import transformers

    task = setup.job["data"]
    rg = reasoning_gym.create_dataset(
        task["task"], size=setup.prompts * (steps + 1), seed=0, **task["task_config"]
    )
    data = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": e["question"]}], "answer": e["answer"]} for e in rg]
    )

    def reward(prompts, completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [setup.reward(t, a) for t, a in zip(texts, answer)]

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t)

    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=setup.prompts * setup.group,
        num_generations=setup.group, steps_per_generation=1, gradient_accumulation_steps=1,
        max_completion_length=setup.new_tokens, temperature=1.0, learning_rate=setup.lr, beta=0.0,
        max_steps=steps, use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, gradient_checkpointing=False,
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    return times[1:]


def time_miles(setup: Setup, steps: int, extra: list[str]) -> list[float]:
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    out = Path(tempfile.mkdtemp())
    argv = [
        "--config", str(setup.config), "--num-rollout", str(steps), "--rollout-batch-size", str(setup.prompts),
        "--n-samples-per-prompt", str(setup.group), "--rollout-max-response-len", str(setup.new_tokens),
        "--rollout-temperature", "1.0", "--lr", str(setup.lr), "--eval-size", "0", "--output-dir", str(out),
        "--no-progress", "--micro-batch-size", str(setup.prompts * setup.group), *extra,
    ]  # fmt: skip
    train(load_config(argv))
    rows = [r for r in read_metrics(out) if "step_time" in r][1:]
    parts = ", ".join(
        f"{k} {statistics.median(r[k] for r in rows):.2f} s" for k in ("rollout_time", "train_time")
    )
    parts += f"; samples with zero advantage {statistics.mean(r['zero_adv_frac'] for r in rows):.0%}"
    print(f"miles, median of {len(rows)} steps: {parts}")
    return [r["step_time"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SETUPS), default="tiny")
    parser.add_argument(
        "--steps", type=int, default=6, help="RL steps per side and round (the first is warm-up)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="times the two sides alternate, each round miles then TRL (default: 3 on tiny, 1 on smollm2, "
        "whose TRL step takes a minute)",
    )
    parser.add_argument(
        "--miles-args",
        action="append",
        help="extra `miles train` flags, one variant each time given (e.g. --miles-args= "
        "--miles-args=--no-skip-zero-advantage times the defaults, then that flag); default: none",
    )
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    setup = SETUPS[args.model]
    rounds = args.rounds or (3 if args.model == "tiny" else 1)
    print(
        f"{args.model}: torch {torch.__version__}, threads {torch.get_num_threads()}; {setup.prompts} prompts x "
        f"{setup.group} samples, at most {setup.new_tokens} new tokens; {rounds} round(s) of {args.steps} steps a side"
    )
    variants = args.miles_args or [""]
    ours: dict[str, list[float]] = {v: [] for v in variants}
    theirs: list[float] = []
    checkpoint = hf_checkpoint(args.model)
    for r in range(rounds):
        for v in variants:
            ours[v] += time_miles(setup, args.steps, v.split())
        theirs += time_trl(setup, checkpoint, args.steps)
        print(
            f"round {r + 1}: miles {statistics.median(ours[variants[0]][-(args.steps - 1) :]):.3f} s, "
            f"TRL {statistics.median(theirs[-(args.steps - 1) :]):.3f} s"
        )
    trl = statistics.median(theirs)
    for v, times in ours.items():
        t = statistics.median(times)
        print(
            f"GRPO step (median of {len(times)}): miles{' ' + v if v else ''} {t:.2f} s | "
            f"TRL GRPOTrainer {trl:.2f} s | miles is {trl / t:.1f}x faster"
        )


if __name__ == "__main__":
    main()
