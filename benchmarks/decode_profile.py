"""Where one decode step of the rollout engine goes: per operator (torch.profiler, self CPU
time) and Python/dispatch vs kernel time, for the tiny MoE at batch 64 and SmolLM2-135M at batch
1 and 16.

    .venv/bin/python benchmarks/decode_profile.py [--only tiny|smollm2] [--steps 32] [--step general]

"dispatch" is wall time minus the summed self time of the operators (Python, the engine's own
bookkeeping, the module tree); "bound" is the time to read the weights and KV cache once at the
memory bandwidth measured by a large copy in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_bound import decode_bound, kv_bytes, memory_bandwidth, weight_bytes
from torch.profiler import ProfilerActivity, profile

from miles.models import registry
from miles.rollout import Engine, Request, SamplingParams


def decode_engine(spec: str, batch: int, path: str, prompt_len: int = 16):
    model, tokenizer = registry.load(spec)
    engine = Engine(model.eval(), tokenizer, batch, max_seq_len=prompt_len + 200, seed=0, decode_step=path)
    params = SamplingParams(temperature=1.0, max_new_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request([(7 * i + j) % 200 + 10 for j in range(prompt_len)], params))
    engine.step()  # prefill (admits everyone) and the first token
    for _ in range(4):
        engine.step()  # warm up
    return engine, model


def profile_decode(spec: str, batch: int, steps: int, bandwidth: float, path: str) -> None:
    engine, model = decode_engine(spec, batch, path)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) / steps / 1e6
    length = next(iter(engine._running.values())).length
    weights, kv = weight_bytes(model), kv_bytes(model, batch, length)  # kv: the filled part of each slot
    limits = decode_bound(model, batch, length, bandwidth)
    bound, gemms = limits.bandwidth_s, limits.gemm_s
    print(
        f"\n{spec}, batch {batch} ({engine.decode_path}): {wall * 1e3:.2f} ms per decode step "
        f"({batch / wall:.0f} tokens/s); operators {total_self * 1e3:.2f} ms, dispatch/Python "
        f"{max(wall - total_self, 0) * 1e3:.2f} ms; weights {weights / 1e6:.1f} MB + KV {kv / 1e6:.1f} MB at "
        f"{bandwidth / 1e9:.1f} GB/s = {bound * 1e3:.2f} ms bound ({bound / wall:.0%} of it reached); "
        f"the step's GEMMs alone {gemms * 1e3:.2f} ms ({gemms / wall:.0%})"
    )
    print(f"{'operator':40s} {'calls/step':>10s} {'self ms/step':>12s} {'share':>6s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        ms = e.self_cpu_time_total / steps / 1e3
        print(f"{e.key[:40]:40s} {e.count / steps:10.1f} {ms:12.3f} {ms / (wall * 1e3):6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per case")
    parser.add_argument(
        "--step", choices=["auto", "fused", "general"], default="auto", help="the engine's decode step"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = memory_bandwidth()[0]
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    cases = [("tiny", 64), ("smollm2", 1), ("smollm2", 16)]
    for spec, batch in cases:
        if args.only in (None, spec):
            profile_decode(spec, batch, args.steps, bandwidth, args.step)


if __name__ == "__main__":
    main()
