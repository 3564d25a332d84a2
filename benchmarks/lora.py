"""LoRA against full fine-tuning: what it learns, what a sync moves, what the trainer holds.

- `curve`: the default job twice for the same number of rollouts, full fine-tuning and LoRA
  (`--lora-rank`, `--lr` of each given below): held-out accuracy at each evaluation side by side.
- `sync`: SmolLM2-135M, an in-process engine: bytes and seconds of one weight sync, every weight
  against the adapters alone (LoRA r=16 on every projection), best of 3.
- `memory`: SmolLM2-135M, one training step on 32 samples: the trainer's weights, gradients and
  AdamW state, full against LoRA r=16, and the step's time.
- `smollm2`: `miles train --model smollm2 --lora-rank 16` for a few rollouts of the default job's
  task (log-prob mismatch between engine and trainer, step time).

    .venv/bin/python benchmarks/lora.py                  # every part (tables of docs/lora.md)
    .venv/bin/python benchmarks/lora.py --only sync,memory
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from miles.config import load_config
from miles.devices import training_memory
from miles.diagnostics.metrics_file import read_metrics
from miles.models import registry
from miles.rollout.engine import Engine
from miles.run import train
from miles.sync.payload import published_weights
from miles.sync.strategy import InProcessBuckets
from miles.train.policy_trainer import PolicyTrainer
from miles.train.prepare import prepare_train_model

DEFAULT = "miles/assets/default_train.yaml"
PARTS = ("curve", "sync", "memory", "smollm2")


def curve(rollouts: int, lora_rank: int, lora_lr: float) -> None:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in (
            ("full", []),
            (f"LoRA r={lora_rank}", ["--lora-rank", str(lora_rank), "--lr", str(lora_lr)]),
        ):
            out = Path(tmp) / name.replace(" ", "_")
            start = time.perf_counter()
            args = [
                "--config",
                DEFAULT,
                "--num-rollout",
                str(rollouts),
                "--output-dir",
                str(out),
                "--no-progress",
            ]
            train(load_config(args + flags))
            records = read_metrics(out)
            runs[name] = (
                {r["rollout"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r},
                time.perf_counter() - start,
                sum(r["train_time"] for r in records if "train_time" in r),
            )
    names = list(runs)
    print(f"\nDefault job, {rollouts} rollouts each (held-out accuracy, 200 problems):")
    print("| after rollout | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for rollout in sorted(runs[names[0]][0]):
        print(
            f"| {rollout + 1} | "
            + " | ".join(f"{runs[n][0].get(rollout, float('nan')):.3f}" for n in names)
            + " |"
        )
    print(
        "| run seconds (training part) | "
        + " | ".join(f"{runs[n][1]:.0f} ({runs[n][2]:.0f})" for n in names)
        + " |"
    )


def _trainer(policy, flags: list[str]) -> PolicyTrainer:
    cfg = load_config(["--config", DEFAULT, "--model", "smollm2", "--eval-size", "0", "--no-use-r3", *flags])
    return PolicyTrainer(prepare_train_model(copy.deepcopy(policy).train(), cfg), cfg)


def sync(policy, rank: int) -> None:
    print(f"\nSmolLM2-135M, one sync to an in-process engine (best of 3); LoRA r={rank} on every projection:")
    print("| what travels | tensors | bytes | seconds |\n|---|---|---|---|")
    rows = {}
    for name, flags in (("every weight", []), (f"adapters (r={rank})", ["--lora-rank", str(rank)])):
        trainer = _trainer(policy, flags)
        engine = Engine(copy.deepcopy(policy).eval(), max_batch_size=4)
        sync = InProcessBuckets(trainer, engine, bucket_bytes=512 * 2**20)
        stats = min((sync.push(v) for v in range(1, 4)), key=lambda s: s.seconds)
        rows[name] = stats
        print(f"| {name} | {stats.tensors} | {stats.payload_bytes / 1e6:.1f} MB | {stats.seconds:.3f} |")
    full, lora = rows.values()
    print(
        f"adapters: {100 * lora.payload_bytes / full.payload_bytes:.1f}% of the bytes, "
        f"{full.seconds / lora.seconds:.1f}x faster (the engine's merge rewrites every adapted weight)"
    )
    import ray
    from weight_sync import to_actor_transports  # benchmarks/weight_sync.py: driver -> another process

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    payloads = {name: list(published_weights(_trainer(policy, flags).model).items()) for name, flags in
                (("every weight", []), (f"adapters (r={rank})", ["--lora-rank", str(rank)]))}  # fmt: skip
    print("\nThe same payloads to an engine-like process (transport only, best of 3):")
    print("| what travels | Ray object store s | weight-update group (gloo) s |\n|---|---|---|")
    for name, named in payloads.items():
        times = to_actor_transports(named, 3)
        print(f"| {name} | {times['actor via store']:.3f} | {times['actor via group']:.3f} |")
    ray.shutdown()


def memory(policy, rank: int, samples: int = 32, length: int = 96) -> None:
    from miles.data.sample import Sample

    gen = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    batch = []
    for _ in range(samples):
        tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
        batch.append(Sample(tokens=tokens, response_length=length // 2, reward=0.0, rollout_log_probs=None))
    advantages = [torch.randn(length // 2, generator=gen) for _ in batch]
    print(f"\nSmolLM2-135M, one training step on {samples} samples of {length} tokens:")
    print("| training | trainable parameters | weights MB | gradients MB | AdamW state MB | step s |")
    print("|---|---|---|---|---|---|")
    for name, flags in (("full", []), (f"LoRA r={rank}", ["--lora-rank", str(rank)])):
        trainer = _trainer(
            policy, flags + ["--micro-batch-size", "8", "--rollout-batch-size", str(samples // 8)]
        )
        trainer.train(batch, advantages)  # the first step allocates AdamW's state
        start = time.perf_counter()
        trainer.train(batch, advantages)
        seconds = time.perf_counter() - start
        held = training_memory(trainer.model, trainer.optimizer)
        count = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(
            f"| {name} | {count / 1e6:.2f} M | {held['weights'] / 1e6:.0f} | {held['grads'] / 1e6:.1f} | "
            f"{held['optimizer'] / 1e6:.1f} | {seconds:.2f} |"
        )


def smollm2(rollouts: int, rank: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        args = ["--config", DEFAULT, "--model", "smollm2", "--lora-rank", str(rank), "--lr", "1e-4"]
        args += ["--num-rollout", str(rollouts), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
        args += ["--rollout-max-response-len", "24", "--eval-size", "0", "--output-dir", out, "--no-progress"]
        args += ["--micro-batch-size", "16", "--check-lora-weight-equal"]
        train(load_config(args))
        rows = [r for r in read_metrics(Path(out)) if "loss" in r]
    print(f"\n`miles train --model smollm2 --lora-rank {rank}`, {rollouts} rollouts of 16 samples:")
    print(
        "| rollout | loss | reward | mean abs logp diff (engine vs trainer) | sync MB | step s |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['rollout']} | {r['loss']:.4f} | {r['reward_mean']:.3f} | {r['train_rollout_logprob_abs_diff']:.1e} | "
            f"{r.get('sync_moved_bytes', 0) / 1e6:.2f} | {r['step_time']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--rollouts", type=int, default=100, help="rollouts of each default-job run (curve)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the SmolLM2 parts")
    parser.add_argument("--curve-rank", type=int, default=8, help="LoRA rank of the default-job run")
    parser.add_argument(
        "--curve-lr", type=float, default=1e-3, help="learning rate of the LoRA default-job run"
    )
    args = parser.parse_args()
    parts = set(args.only.split(","))
    torch.manual_seed(0)
    if "curve" in parts:
        curve(args.rollouts, args.curve_rank, args.curve_lr)
    if parts & {"sync", "memory"}:
        policy, _ = registry.load("smollm2")
        if "sync" in parts:
            sync(policy, args.rank)
        if "memory" in parts:
            memory(policy, args.rank)
    if "smollm2" in parts:
        smollm2(3, args.rank)


if __name__ == "__main__":
    main()
