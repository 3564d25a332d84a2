"""What `--rollout-compile` (miles/rollout/compiled_decode.py) gives per decode step, against the
engine's lean eager step (miles/rollout/fast_decode.py), on the same cache and weights.

    .venv/bin/python benchmarks/compiled_decode.py [--model tiny|smollm2] [--batch 64]

Printed: compile time, ms per step of each, and the largest logit difference (fused kernels
round differently).
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
    got = compiled(ids, positions, cache).logits  # compiles
    print(
        f"{args.model}, batch {args.batch}, {args.length} KV positions: compile {compiled.compile_seconds:.1f} s; "
        f"lean eager {median_ms(lambda: lean(ids, positions, cache)):.2f} ms/step, "
        f"compiled {median_ms(lambda: compiled(ids, positions, cache)):.2f} ms/step; "
        f"largest logit difference {(got - want).abs().max():.1e}"
    )


if __name__ == "__main__":
    main()
