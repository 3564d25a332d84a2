"""Memory controls on the default job's model: what each saves and what it costs.

One rollout of the default job's policy with long, mixed responses (temperature 1, up to
--response-len tokens) is generated once; then one training step on those samples runs under
each setting on a fresh copy of the model, measuring the step's peak memory above the process's
resident size before it (host RSS: activations, gradients and optimizer state) and its time:

- fixed micro-batches (--micro-batch-size) against token budgets (--use-dynamic-batch-size
  --max-tokens-per-gpu), and with --recompute-activations;
- --auto-batch with a memory budget the largest fixed micro-batch exceeds;
- expert parallelism over two gloo ranks with and without --offload-experts: the expert bytes
  resident on the compute device at once (on CPU host and device are one memory, so the RSS
  does not fall; on a GPU that residency is the device memory saved).

    .venv/bin/python benchmarks/memory.py            # prints the tables of docs/memory.md
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from miles.config import load_config
from miles.devices import measure_peak
from miles.models import registry
from miles.rollout.engine import Engine
from miles.rollout.sampling import Request, SamplingParams
from miles.train.policy_trainer import PolicyTrainer
from miles.train.prepare import prepare_train_model

DEFAULT = "miles/assets/default_train.yaml"


def rollout(samples: int, response_len: int):
    """One batch of the default job's prompts answered by its policy, each response of a length
    drawn uniformly from 8..response_len (an RL batch's long tail)."""
    from miles.data.run_data import build_data
    from miles.models.tokenizer import encode_prompt

    cfg = load_config(
        ["--config", DEFAULT, "--rollout-max-response-len", str(response_len), "--eval-size", "0"]
    )
    policy, tokenizer = registry.load(cfg.model.model, seed=cfg.train.seed)
    data = build_data(cfg)
    items = data.train.take(samples)
    engine = Engine(copy.deepcopy(policy).eval(), tokenizer, max_batch_size=64, seed=1)
    lengths = torch.randint(8, response_len + 1, (samples,), generator=torch.Generator().manual_seed(0))
    requests = [
        Request(
            encode_prompt(tokenizer, item.prompt, cfg.data.apply_chat_template),
            SamplingParams(temperature=1.0, max_new_tokens=int(n), ignore_eos=True),
        )
        for item, n in zip(items, lengths)
    ]
    out = engine.generate(requests)
    for s in out:
        s.rollout_log_probs = None  # the trainer's own log-probs are the old policy
    return policy, out


def train_step(policy, samples, flags: list[str], repeats: int = 2) -> tuple[float, float, PolicyTrainer]:
    """(peak GB above the resident size before, seconds) of one training step under `flags`: the
    fastest of `repeats` steps, each on a fresh copy (the first pays the allocator's warm-up)."""
    runs = [_train_once(policy, samples, flags) for _ in range(repeats)]
    peak = max(r[0] for r in runs)
    return peak, min(r[1] for r in runs), runs[-1][2]


def _trainer(policy, samples, flags: list[str]) -> PolicyTrainer:
    """A trainer on a fresh copy of the policy, the default job's settings plus `flags`."""
    cfg = load_config(
        [
            "--config",
            DEFAULT,
            "--rollout-batch-size",
            str(len(samples) // 8),
            "--eval-size",
            "0",
            "--no-use-r3",
            *flags,
        ]
    )
    return PolicyTrainer(prepare_train_model(copy.deepcopy(policy).train(), cfg), cfg)


def _timed_step(trainer: PolicyTrainer, samples) -> tuple[float, float]:
    """(peak GB above the resident size before, seconds) of one training step."""
    advantages = [torch.randn(s.response_length) for s in samples]
    with measure_peak() as before:
        pass
    start = time.perf_counter()
    with measure_peak() as peak:
        trainer.train(samples, advantages)
    return (peak["peak_rss"] - before["peak_rss"]) / 1e9, time.perf_counter() - start


def _train_once(policy, samples, flags: list[str]) -> tuple[float, float, PolicyTrainer]:
    trainer = _trainer(policy, samples, flags)
    return (*_timed_step(trainer, samples), trainer)


def batching_table(policy, samples, only_auto: bool = False) -> None:
    lengths = [len(s.tokens) for s in samples]
    print(
        f"\n{len(samples)} samples, {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f})"
    )
    print("| setting | micro-batches | peak above resident (GB) | step s |\n|---|---|---|---|")
    settings = [
        ("--micro-batch-size 256", ["--micro-batch-size", "256"]),
        ("--micro-batch-size 64", ["--micro-batch-size", "64"]),
        ("--micro-batch-size 16", ["--micro-batch-size", "16"]),
        ("--max-tokens-per-gpu 8192", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192"]),
        ("--max-tokens-per-gpu 2048", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"]),
        (
            "--micro-batch-size 256 --recompute-activations",
            ["--micro-batch-size", "256", "--recompute-activations"],
        ),
        (
            "--max-tokens-per-gpu 8192 --recompute-activations",
            ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--recompute-activations"],
        ),
    ]
    results = {}
    for name, flags in settings if not only_auto else settings[:1]:
        peak, seconds, trainer = train_step(policy, samples, flags)
        count = len(trainer.micro_batches(range(len(samples)), samples))
        results[name] = peak
        print(f"| `{name}` | {count} | {peak:.3f} | {seconds:.2f} |")
    auto_table(policy, samples, results["--micro-batch-size 256"] * 0.5)


def auto_table(policy, samples, budget: float, steps: int = 4) -> None:
    """--auto-batch over `steps` steps of one trainer: the first probes (small micro-batches while
    it measures), the later ones run at the size it settled on."""
    resident = _resident_gb()
    trainer = _trainer(policy, samples, ["--auto-batch", "--memory-budget-gb", f"{resident + budget:.3f}"])
    peaks, times = zip(*(_timed_step(trainer, samples) for _ in range(steps)))
    print(f"\n--auto-batch, budget half the 256-sample peak ({budget:.3f} GB above resident), {steps} steps:")
    print(
        f"| `--auto-batch --memory-budget-gb {resident + budget:.2f}` | settled on {trainer.auto.tokens} tokens | "
        f"{max(peaks):.3f} (max over steps) | {times[0]:.2f} first step (probing), {min(times[1:]):.2f} after |"
    )


def _resident_gb() -> float:
    """This process's resident size now, after handing freed heap back (as the trainer measures)."""
    with measure_peak():
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def _ep_rank(rank: int, port: int, offload: bool, out) -> None:
    import torch.distributed as dist

    from miles.train import expert_parallel
    from miles.train.expert_offload import expert_parameters, offload_experts

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    policy, _ = registry.load("tiny", seed=0)
    model = policy.train()
    loader = offload_experts(model) if offload else None
    ep = expert_parallel.setup(model, rank, 2, 2)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (16, 64), generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    loss = model(ids).logits.float().logsumexp(-1).mean()
    (loss * 2).backward()
    expert_parallel.all_reduce_gradients(model, ep, True)
    seconds = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for _, p in expert_parameters(model))
    resident = loader.peak if loader is not None else held
    out.put((rank, offload, held, resident, seconds))
    dist.destroy_process_group()


def expert_table() -> None:
    import torch.multiprocessing as mp

    from miles.runtime.placement import free_port

    print("\nEP=2 (two gloo ranks, tiny MoE, 16 x 64 tokens a rank, forward + backward):")
    print(
        "| setting | expert bytes a rank holds | expert bytes on the compute device at once | s |\n|---|---|---|---|"
    )
    ctx = mp.get_context("spawn")
    for offload in (False, True):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_ep_rank, args=(r, port, offload, queue)) for r in range(2)]
        for p in procs:
            p.start()
        rows = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        _, _, held, resident, seconds = max(rows, key=lambda r: r[3])
        name = "--expert-model-parallel-size 2" + (" --offload-experts" if offload else "")
        print(f"| `{name}` | {held / 1e6:.2f} MB | {resident / 1e6:.3f} MB | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=256, help="samples in the training step (the default job's)"
    )
    parser.add_argument("--response-len", type=int, default=256, help="longest response of the rollout")
    parser.add_argument("--only", choices=("batching", "auto", "experts"), help="one table only")
    args = parser.parse_args()
    if args.only != "experts":
        policy, samples = rollout(args.samples, args.response_len)
        batching_table(policy, samples, only_auto=args.only == "auto")
    if args.only in (None, "experts"):
        expert_table()


if __name__ == "__main__":
    main()
