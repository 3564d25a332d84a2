"""Time per GRPO step: TRL's GRPOTrainer and `miles train`, same model, task, batch and lengths.

    .venv/bin/pip install trl            # benchmark-only dependency
    .venv/bin/python benchmarks/grpo_step_vs_trl.py [--steps 6]

Both train the shipped tiny Qwen3-MoE base model (miles/assets/tiny-moe-base, which transformers
loads as Qwen3MoeForCausalLM) on reasoning-gym basic_arithmetic prompts in the chat template:
32 prompts x 8 samples per step, at most 8 new tokens, temperature 1, AdamW at the same LR, no
reference model (beta 0), one optimizer step per rollout. The first step of each is warm-up and
not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "miles" / "assets" / "tiny-moe-base"
JOB = yaml.safe_load((ROOT / "miles" / "assets" / "default_train.yaml").read_text())
TASK_CONFIG = JOB["data"]["task_config"]
PROMPTS, GROUP, NEW_TOKENS, LR = 32, 8, 8, 2e-4


def time_trl(steps: int) -> list[float]:
    import datasets
    import reasoning_gym
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    rg = reasoning_gym.create_dataset("basic_arithmetic", size=PROMPTS * (steps + 1), seed=0, **TASK_CONFIG)
    data = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": e["question"]}], "answer": e["answer"]} for e in rg]
    )

    def reward(prompts, completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t.strip() == a) for t, a in zip(texts, answer)]

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0,
        learning_rate=LR, beta=0.0, max_steps=steps, use_cpu=True, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(BASE)
    model = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    return times[1:]


def time_miles(steps: int) -> list[float]:
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    out = Path(tempfile.mkdtemp())
    argv = [
        "--config", str(ROOT / "miles" / "assets" / "default_train.yaml"), "--num-rollout", str(steps),
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(GROUP), "--rollout-max-response-len",
        str(NEW_TOKENS), "--lr", str(LR), "--eval-size", "0", "--output-dir", str(out), "--no-progress",
        "--micro-batch-size", str(PROMPTS * GROUP),
    ]  # fmt: skip
    train(load_config(argv))
    return [r["step_time"] for r in read_metrics(out) if "step_time" in r][1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="RL steps per side (the first is warm-up)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; {PROMPTS} prompts x {GROUP} samples, {NEW_TOKENS} new tokens"
    )
    ours = statistics.median(time_miles(args.steps))
    theirs = statistics.median(time_trl(args.steps))
    print(
        f"GRPO step (median of {args.steps - 1}): miles {ours:.2f} s | TRL GRPOTrainer {theirs:.2f} s | miles is {theirs / ours:.1f}x faster"
    )


if __name__ == "__main__":
    main()
