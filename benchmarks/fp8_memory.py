"""FP8 engine memory and speed against the fp32 engine, same model, one run.

    .venv/bin/python benchmarks/fp8_memory.py                 # tiny MoE and SmolLM2-135M
    .venv/bin/python benchmarks/fp8_memory.py --only tiny

For each model: the bytes of the projections the FP8 engine quantizes (float8 codes + scales)
against the same projections in fp32, the whole model's bytes both ways, and decoding speed of
the FP8 engine (emulated on CPU: dequantize -> fp32 matmul) against the fp32 engine on the same
prompts (16 prompts x 32 new tokens, EOS ignored).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from miles.models import registry
from miles.quant.convert import to_fp8, weight_bytes
from miles.quant.linear import FP8Spec
from miles.rollout import Engine, Request, SamplingParams


def model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_seconds(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    engine = Engine(model, tokenizer, max_batch_size=len(prompts), max_seq_len=64 + new_tokens, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([Request(p, params) for p in prompts[:2]])  # warm-up
    t0 = time.perf_counter()
    engine.generate([Request(p, params) for p in prompts])
    return time.perf_counter() - t0


def run(name: str, new_tokens: int = 32) -> None:
    policy, tokenizer = registry.load(name)
    policy.eval()
    fp8 = copy.deepcopy(policy)
    to_fp8(fp8, FP8Spec("blockwise"), store_codes=True)
    stored, fp32 = weight_bytes(fp8)
    whole_fp32, whole_fp8 = model_bytes(policy), model_bytes(fp8)
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {2 * i}?") for i in range(16)]
    t32 = decode_seconds(policy, tokenizer, prompts, new_tokens)
    t8 = decode_seconds(fp8, tokenizer, prompts, new_tokens)
    print(
        f"| {name} | {stored / 1e6:.2f} MB / {fp32 / 1e6:.2f} MB = {stored / fp32:.1%} | "
        f"{whole_fp8 / 1e6:.1f} MB / {whole_fp32 / 1e6:.1f} MB = {whole_fp8 / whole_fp32:.1%} | "
        f"{16 * new_tokens / t32:.0f} | {16 * new_tokens / t8:.0f} | {t8 / t32:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "smollm2"))
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print("| model | FP8 projections / fp32 | whole model FP8 / fp32 | fp32 tok/s | FP8 tok/s | FP8 time |")
    print("|---|---|---|---|---|---|")
    for name in [args.only] if args.only else ["tiny", "smollm2"]:
        run(name)


if __name__ == "__main__":
    main()
