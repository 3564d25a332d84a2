"""What `--rollout-compile` (miles/rollout/compiled_decode.py) gives per decode step, against the
engine's lean eager step (miles/rollout/fast_decode.py), on the same cache and weights.

    .venv/bin/python benchmarks/compiled_decode.py [--model tiny|smollm2] [--batch 64]

Printed: compile time, ms per step of each, and the largest logit difference (fused kernels
round differently); the same for the compiled step with its projections on oneDNN
(`--rollout-onednn`: every one past 4 rows, not only those measured faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from miles.models import registry
from miles.rollout import Engine
from miles.rollout.compiled_decode import CompiledDecode


def median_ms(fn, calls: int = 20, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128, help="KV positions of the cache")
    args = parser.parse_args()
    model, tok = registry.load(args.model)
    engine = Engine(model.eval(), tok, args.batch, max_seq_len=args.length, packed_gemm=False)
    lean, cache = engine._fast, engine.cache
    compiled = CompiledDecode(lean, args.batch, args.length)
    ids = torch.randint(0, model.config.vocab_size, (args.batch,))
    positions = torch.randint(args.length // 4, args.length - 1, (args.batch,))
    want = lean(ids, positions, cache).logits
    sides = {"lean eager": lean}
    for onednn in (False, True):
        compiled = CompiledDecode(lean, args.batch, args.length, onednn=onednn, measure=False)
        got = compiled(ids, positions, cache).logits  # compiles
        name = "compiled" + (" + oneDNN" if compiled.packed else "")
        print(
            f"{name}: compile {compiled.compile_seconds:.1f} s, largest logit difference from lean "
            f"{(got - want).abs().max():.1e}"
        )
        sides[name] = compiled
    for _ in range(2):  # interleaved, so the machine's drift hits every side
        line = ", ".join(
            f"{name} {median_ms(lambda f=f: f(ids, positions, cache)):.2f}" for name, f in sides.items()
        )
        print(f"{args.model}, batch {args.batch}, {args.length} KV positions, ms per step: {line}")


if __name__ == "__main__":
    main()
