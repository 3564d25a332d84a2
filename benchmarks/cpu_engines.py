"""The CPU engines a user would pick instead of miles, on the same work: ctranslate2 (fp32 and
int8, converted from miles' own SmolLM2 checkpoint by `TransformersConverter`) and llama.cpp
(`llama-cpp-python` on the shipped Q4_1 GGUF), against miles' engine in fp32, FP8 and INT4.

Peers install on first use into a cache folder (`$MILES_PEERS`, default ~/.cache/miles/peers:
`pip install --target`), never into the project's requirements; one that cannot be installed
is reported with its error and left out. Workloads (the same prompts, temperature 0.7 over the
whole vocabulary, EOS ignored, tokens counted per engine):

- batch 1 x 128 tokens; batch 16 x 64 tokens;
- RL-like mixed: 64 prompts whose responses end at lengths drawn uniformly from 8..128, 16
  slots; miles refills a slot as a request ends, ctranslate2 runs batches of 16 to their longest
  row (only the requested tokens count), llama.cpp's Python binding decodes one request at a time.

Each cell is the median of 3 runs, the engines alternating within each round. "bound": the fp32
decode step's limit at that batch (the weights and the KV cache read once at the measured memory
bandwidth, or the step's GEMMs, whichever is slower; `decode_bound.py`).

    .venv/bin/python benchmarks/cpu_engines.py            # the table of docs/performance.md
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode_bound import decode_bound, memory_bandwidth

from miles.config import load_config
from miles.models import registry, save_model
from miles.models.gguf import smollm2_gguf_path
from miles.quant.convert import prepare_rollout_model
from miles.rollout import Engine, Request, SamplingParams

PEERS = Path(os.environ.get("MILES_PEERS", Path.home() / ".cache" / "miles" / "peers"))
TEMPERATURE = 0.7
PEER_DEPS = {"llama-cpp-python": ["diskcache"]}  # what a peer needs beyond what the project installs


def peer(module: str, package: str):
    """`module` from the peers' cache folder, installed there first if missing; None (with the
    reason printed) when it cannot be had."""
    target = PEERS / module
    sys.path.insert(0, str(target))
    try:
        return __import__(module)
    except ImportError:
        pass
    print(f"installing {package} into {target} ...", flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), package,
         *PEER_DEPS.get(package, [])],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        print(f"{package}: cannot be installed here: {proc.stderr.strip().splitlines()[-1:]}")
        return None
    try:
        return __import__(module)
    except ImportError as e:
        print(f"{package}: installed but does not import: {e}")
        return None


def workloads(tokenizer) -> list[tuple[str, list[list[int]], list[int], int]]:
    prompts = [
        tokenizer(f"Question {i}: tell me a story about the number {i * 7 % 97}.").input_ids
        for i in range(64)
    ]
    rng = random.Random(0)
    mixed = [rng.randint(8, 128) for _ in range(64)]
    return [
        ("batch 1 x 128", prompts[:1], [128], 1),
        ("batch 16 x 64", prompts[:16], [64] * 16, 16),
        ("mixed: 64 requests, 8-128 tokens, 16 slots", prompts, mixed, 16),
    ]


def run_miles(model, tokenizer, prompts, lengths, slots) -> float:
    engine = Engine(
        model, tokenizer, max_batch_size=slots, max_seq_len=max(map(len, prompts)) + max(lengths) + 1
    )
    requests = [
        Request(list(p), SamplingParams(temperature=TEMPERATURE, max_new_tokens=n, ignore_eos=True, seed=i))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    t0 = time.perf_counter()
    samples = engine.generate(requests)
    return sum(s.response_length for s in samples) / (time.perf_counter() - t0)


def run_ct2(generator, tokenizer, prompts, lengths, slots) -> float:
    t0, done = time.perf_counter(), 0
    for i in range(0, len(prompts), slots):
        batch, want = prompts[i : i + slots], lengths[i : i + slots]
        tokens = [tokenizer.convert_ids_to_tokens(p) for p in batch]
        longest = max(want)
        generator.generate_batch(
            tokens, max_length=longest, min_length=longest, sampling_topk=0, sampling_temperature=TEMPERATURE,
            include_prompt_in_result=False,
        )  # fmt: skip
        done += sum(want)
    return done / (time.perf_counter() - t0)


def run_llama(llm, prompts, lengths, eos: int) -> float:
    t0, done = time.perf_counter(), 0
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        llm.reset()
        out = llm.create_completion(
            list(p), max_tokens=n, temperature=TEMPERATURE, top_k=0, top_p=1.0, seed=i, logit_bias={eos: -1e9}
        )
        done += out["usage"]["completion_tokens"]
    return done / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--peers", default="ctranslate2,llama.cpp", help="comma-separated: ctranslate2, llama.cpp"
    )
    parser.add_argument(
        "--miles", default="fp32,fp8,int4", help="comma-separated miles engines: fp32, fp8, int4"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    policy, tokenizer = registry.load("smollm2")
    engines = {"miles fp32": lambda: policy}
    for key, name, flags in (
        ("fp8", "miles FP8", ["--fp8-rollout-only"]),
        ("int4", "miles INT4", ["--int4-rollout-only", "--int4-group-size", "64"]),
    ):
        if key in args.miles.split(","):
            cfg = load_config(["--model", "smollm2", *flags])
            engines[name] = lambda cfg=cfg: prepare_rollout_model(registry.load("smollm2")[0], cfg)
    built = {name: make() for name, make in engines.items()}
    runners = {name: functools.partial(run_miles, m, tokenizer) for name, m in built.items()}
    wanted = args.peers.split(",")
    ct2 = peer("ctranslate2", "ctranslate2") if "ctranslate2" in wanted else None
    if ct2 is not None:
        source = tempfile.mkdtemp()
        save_model(policy, source, tokenizer=tokenizer)
        for compute in ("float32", "int8"):
            out = Path(tempfile.mkdtemp()) / compute
            ct2.converters.TransformersConverter(source).convert(str(out), quantization=compute)
            gen = ct2.Generator(str(out), device="cpu", compute_type=compute, intra_threads=2)
            runners[f"ctranslate2 {compute}"] = (lambda g: lambda p, n, s: run_ct2(g, tokenizer, p, n, s))(
                gen
            )
    llama_cpp = peer("llama_cpp", "llama-cpp-python") if "llama.cpp" in wanted else None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=str(smollm2_gguf_path()), n_ctx=512, n_threads=2, verbose=False)
        eos = tokenizer.eos_token_id
        runners["llama.cpp Q4_1"] = lambda p, n, s: run_llama(llm, p, n, eos)  # one request at a time
    bandwidth = memory_bandwidth()[0]
    print(f"SmolLM2-135M, 2 threads, temperature {TEMPERATURE}; median of {args.repeats} (tokens/s)")
    names = list(runners)
    print("| workload | " + " | ".join(names) + " | fp32 bound |")
    print("|---" * (len(names) + 2) + "|")
    for label, prompts, lengths, slots in workloads(tokenizer):
        rates = {n: [] for n in names}
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each round starts one further on
                rates[name].append(runners[name](prompts, lengths, slots))
        med = {n: statistics.median(v) for n, v in rates.items()}
        bound = decode_bound(policy, slots, max(map(len, prompts)) + max(lengths), bandwidth)
        cells = [f"{med[n]:.0f}" for n in names]
        print(
            f"| {label} | " + " | ".join(cells) + f" | {slots / bound.tighter_s:.0f} ({bound.which}) |",
            flush=True,
        )
        best = max((v, n) for n, v in med.items() if not n.startswith("miles"))
        if best:
            print(f"  miles fp32 / best peer ({best[1]}): {med['miles fp32'] / best[0]:.2f}x")


if __name__ == "__main__":
    main()
