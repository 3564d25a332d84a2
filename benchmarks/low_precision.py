"""Low-precision rollout engines against the fp32 engine: weight bytes and decoding speed, one run.

    .venv/bin/python benchmarks/low_precision.py                 # tiny MoE and SmolLM2-135M
    .venv/bin/python benchmarks/low_precision.py --only smollm2

For each model and format (FP8 blockwise; INT4 with fp32 and with bf16 kernel activations): the
bytes of the projections the engine quantizes (codes + scales) against the same projections in
fp32 and in bf16, and decoding tokens/s against the fp32 engine on the same prompts at batch 1
(weight-bandwidth bound) and batch 16, EOS ignored. FP8 is emulated on CPU (dequantize -> fp32
matmul); INT4 with fp32 activations runs in the fused decode step on the codes, with bf16
activations torch's CPU INT4 kernel on its own packing.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from miles.models import registry
from miles.quant.convert import to_fp8, to_int4, weight_bytes
from miles.quant.fp8_linear import FP8Spec
from miles.rollout import Engine, Request, SamplingParams


def decode_tokens_per_second(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    engine = Engine(model, tokenizer, max_batch_size=len(prompts), max_seq_len=64 + new_tokens, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([Request(p, params) for p in prompts[:2]])  # warm-up
    t0 = time.perf_counter()
    engine.generate([Request(p, params) for p in prompts])
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def formats(name: str) -> dict:
    group = 64  # divides SmolLM2's 576 and 1536 and the tiny model's 128
    return {
        "FP8 blockwise": lambda m: to_fp8(m, FP8Spec("blockwise"), store_codes=True),
        f"INT4 g{group}, fp32 act.": lambda m: to_int4(m, group, store_packed=True, activations="fp32"),
        f"INT4 g{group}, bf16 act.": lambda m: to_int4(m, group, store_packed=True, activations="bf16"),
    }


def run(name: str, new_tokens: int) -> None:
    policy, tokenizer = registry.load(name)
    policy.eval()
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {2 * i}?") for i in range(16)]
    base = {b: decode_tokens_per_second(policy, tokenizer, prompts[:b], new_tokens) for b in (1, 16)}
    print(f"| {name} | fp32 | 100% | 200% | {base[1]:.0f} tok/s | {base[16]:.0f} tok/s |")
    for label, convert in formats(name).items():
        model = copy.deepcopy(policy)
        convert(model)
        stored, fp32 = weight_bytes(model)
        speed = {b: decode_tokens_per_second(model, tokenizer, prompts[:b], new_tokens) for b in (1, 16)}
        print(
            f"| {name} | {label} | {stored / fp32:.1%} | {stored / (fp32 / 2):.1%} | "
            f"{speed[1]:.0f} tok/s ({speed[1] / base[1]:.2f}x) | {speed[16]:.0f} tok/s ({speed[16] / base[16]:.2f}x) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "smollm2"))
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print("| model | engine | projection bytes / fp32 | / bf16 | batch 1 | batch 16 |")
    print("|---|---|---|---|---|---|")
    for name in [args.only] if args.only else ["tiny", "smollm2"]:
        run(name, args.new_tokens)


if __name__ == "__main__":
    main()
