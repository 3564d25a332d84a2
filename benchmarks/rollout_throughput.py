"""Rollout throughput: the miles engine against transformers' `generate`, same work, one run,
and against the machine's own limit for a decode step (`decode_bound.py`).

    .venv/bin/python benchmarks/rollout_throughput.py            # tiny MoE @64, SmolLM2 @16 and @1
    .venv/bin/python benchmarks/rollout_throughput.py --only tiny
    .venv/bin/python benchmarks/rollout_throughput.py --only tiny --engines 2   # also 2 Ray engines
    .venv/bin/python benchmarks/rollout_throughput.py --general            # also the general forward

Both sides get the same model weights, the same prompts and temperature-1 sampling, and
produce the same number of tokens. miles runs its default decode step (`--rollout-decode-step
auto`: the fused step on CPU). Each cell is the median of --repeats runs (default 3), the sides
(miles, miles with each asked step, transformers) alternating, each round starting one side
further along (a side's place in the round can move it by up to ~20%). Two workloads:

- fixed: every prompt gets the same number of new tokens (EOS ignored): raw decoding speed.
- mixed (RL-like): 4 batches' worth of prompts whose responses end at different lengths (drawn
  uniformly, as EOS does in RL). transformers runs them in batches of `batch`, each row stopped
  by a per-row stopping criterion at its length; miles gets them all at once with `batch` cache
  slots and refills a slot as soon as its request ends (continuous batching).

"bound" is the decode-only throughput at the batch size that the tighter of two limits allows:
every weight and the filled KV cache read once per step at the measured memory bandwidth (the
faster of a copy and a read), or the step's GEMMs alone. The measured throughput includes the
prefill and sampling, so its fraction is conservative; the line under it gives the decode steps
alone (their forwards, timed by the engine: `Engine.times`), the like-for-like fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import statistics
import tempfile
import time

import torch
import transformers
from decode_bound import decode_bound, memory_bandwidth

from miles.models import registry, save_model
from miles.rollout import Engine, Request, SamplingParams


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    texts = [f"Question {i}: what is {i * 7 % 97} plus {i * 13 % 89}? Answer:" for i in range(n)]
    return [tokenizer(t).input_ids for t in texts]


def hf_model_of(model):
    """The same weights as a transformers model (saved and reloaded as an HF checkpoint)."""
    tmp = tempfile.mkdtemp()
    save_model(model, tmp)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)


class StopAtLength(transformers.StoppingCriteria):
    """Row i is done once it has lengths[i] new tokens (what EOS does at that point)."""

    def __init__(self, prompt_len: int, lengths: list[int]) -> None:
        self.prompt_len, self.lengths = prompt_len, torch.tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.lengths


def run_hf(hf, tokenizer, prompts, lengths: list[int], batch: int, temperature: float = 1.0) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, chunk_len = prompts[i : i + batch], lengths[i : i + batch]
        T = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (T - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                max_new_tokens=max(chunk_len), pad_token_id=pad, eos_token_id=None,
                stopping_criteria=transformers.StoppingCriteriaList([StopAtLength(T, chunk_len)]),
            )  # fmt: skip
        assert out.shape[1] - T == max(chunk_len)
    return sum(lengths) / (time.perf_counter() - start)


def miles_engine(model, tokenizer, prompts, lengths: list[int], batch: int, step: str = "auto"):
    """An engine for the workload (its decode step built before any timing) and its requests."""
    engine = Engine(
        model, tokenizer, max_batch_size=batch, max_seq_len=max(map(len, prompts)) + max(lengths) + 1,
        decode_step=step,
    )  # fmt: skip
    requests = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths)
    ]
    return engine, requests


def tokens_per_second(generate, requests: list[Request]) -> float:
    """Tokens per second of one `generate` of the requests (each must get all its tokens); the
    requests are copied before the clock starts (transformers' side is given ready tensors too)."""
    requests_copy = copy.deepcopy(requests)
    start = time.perf_counter()
    samples = generate(requests_copy)
    seconds = time.perf_counter() - start
    assert [s.response_length for s in samples] == [r.params.max_new_tokens for r in requests]
    return sum(s.response_length for s in samples) / seconds


def run_miles(engine: Engine, requests: list[Request]) -> tuple[float, float]:
    """Tokens per second of one run of the engine on the requests, and of its decode steps
    alone (the forwards of the one-token steps, no prefill and no sampling: what the per-step
    bound models)."""
    engine.take_times()  # counts start from here
    rate = tokens_per_second(engine.generate, requests)
    return rate, engine.take_times().decode_tokens_per_second


def ray_engines(spec: str, engines: int, batch: int, max_seq_len: int):
    """`engines` Ray engine actors of one thread each (the multi-engine rollout's shape), sharing
    `batch` slots; a local Ray of `engines` CPUs is started for them."""
    import ray

    from miles.runtime.ray_rollout import RolloutManager

    if not ray.is_initialized():
        ray.init(num_cpus=engines, include_dashboard=False, log_to_driver=False)
    manager = RolloutManager(
        spec, num_engines=engines, max_batch_size=batch // engines, max_seq_len=max_seq_len
    )
    warm = [Request([1 + i, 2, 3], SamplingParams(max_new_tokens=2)) for i in range(2 * engines)]
    manager.generate(warm)  # every actor is up and has run a step
    return manager


def decode_line(workload: str, which: str, rate: float, bound_tps: float, bw_tps: float) -> str:
    """The decode steps alone against the per-step bound (the like-for-like fraction)."""
    return (
        f"{'':<9} {workload:<5} decode steps only{which}: {rate:7.0f} tok/s | "
        f"{rate / bound_tps:4.0%} of the bound, {rate / bw_tps:4.0%} of bandwidth"
    )


def bench(
    name: str,
    spec: str,
    batch: int,
    new_tokens: int,
    repeats: int,
    bandwidth: float,
    mixed=True,
    engines=0,
    general=False,
) -> list:
    with contextlib.redirect_stderr(io.StringIO()):
        model, tokenizer = registry.load(spec)
        hf = hf_model_of(model).eval()
    model.eval()
    run_miles(*miles_engine(model, tokenizer, prompts_for(tokenizer, 2), [2, 2], 2))  # warm-up both
    run_hf(hf, tokenizer, prompts_for(tokenizer, 2), [2, 2], 2)
    gen = torch.Generator().manual_seed(0)
    workloads = {"fixed": (prompts_for(tokenizer, batch), [new_tokens] * batch)}
    if mixed:
        workloads["mixed"] = (
            prompts_for(tokenizer, 4 * batch),
            torch.randint(new_tokens // 8, 2 * new_tokens + 1, (4 * batch,), generator=gen).tolist(),
        )
    rows = []
    longest = max(len(p) for p, _ in zip(*workloads["mixed" if mixed else "fixed"])) + 2 * new_tokens + 1
    many = ray_engines(spec, engines, batch, longest) if engines else None
    for workload, (prompts, lengths) in workloads.items():
        default = miles_engine(model, tokenizer, prompts, lengths, batch)
        variants = {}  # other decode steps, each alternating with the rest
        if general:
            variants["--rollout-decode-step general"] = miles_engine(
                model, tokenizer, prompts, lengths, batch, step="general"
            )
        sides = {"miles": functools.partial(run_miles, *default)}
        sides.update({which: functools.partial(run_miles, *engine) for which, engine in variants.items()})
        if many is not None:
            sides["many"] = functools.partial(tokens_per_second, many.generate, default[1])
        sides["transformers"] = functools.partial(run_hf, hf, tokenizer, prompts, lengths, batch)
        results: dict[str, list] = {side: [] for side in sides}
        order = list(sides)
        for r in range(repeats):  # the sides alternate, each round starting one further along:
            for side in order[r % len(order) :] + order[: r % len(order)]:  # drift and order hit all alike
                results[side].append(sides[side]())
        spread = results.get("many", [])
        theirs = statistics.median(results["transformers"])
        ours, decode_only = (statistics.median(x) for x in zip(*results["miles"]))
        context = round(statistics.mean(map(len, prompts)) + statistics.mean(lengths) / 2)
        bound = decode_bound(model, batch, context, bandwidth)
        bound_tps = batch / bound.tighter_s
        bw_tps = batch / bound.bandwidth_s
        print(
            f"{name:<9} {workload:<5} batch {batch:>3}, {len(prompts):>3} prompts, {sum(lengths):>6} tokens: "
            f"miles {ours:7.0f} tok/s | transformers generate {theirs:7.0f} tok/s | ratio {ours / theirs:5.2f}x | "
            f"bound {bound_tps:7.0f} tok/s ({bound.which}; bandwidth {bw_tps:.0f}) | "
            f"{ours / bound_tps:4.0%} of the bound, {ours / bw_tps:4.0%} of bandwidth ({default[0].decode_path})",
            flush=True,
        )
        print(decode_line(workload, "", decode_only, bound_tps, bw_tps), flush=True)
        for which, engine in variants.items():
            rate, decode_rate = (statistics.median(x) for x in zip(*results[which]))
            print(
                f"{'':<9} {workload:<5} with {which}: miles {rate:7.0f} tok/s | ratio {rate / theirs:5.2f}x | "
                f"{rate / bound_tps:4.0%} of the bound, {rate / bw_tps:4.0%} of bandwidth ({engine[0].decode_path})",
                flush=True,
            )
            print(decode_line(workload, f" {which}", decode_rate, bound_tps, bw_tps), flush=True)
        if spread:
            rate = statistics.median(spread)
            print(
                f"{'':<9} {workload:<5} {engines} Ray engines, 1 thread and {batch // engines} slots each: "
                f"miles {rate:7.0f} tok/s | ratio {rate / theirs:5.2f}x",
                flush=True,
            )
        rows.append((name, workload, batch, ours, theirs))
    if many is not None:
        many.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        choices=["tiny", "smollm2", "smollm2-16", "smollm2-1"],
        help="one model (or one SmolLM2 batch) only",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per side and cell (median)")
    parser.add_argument(
        "--general", action="store_true", help="also run the engine with --rollout-decode-step general"
    )
    parser.add_argument(
        "--engines",
        type=int,
        default=0,
        help="also run N Ray engine actors of one thread each, sharing the batch's slots (the "
        "multi-engine rollout; one per core is the natural count)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth, copy_bw, read_bw = memory_bandwidth()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}, "
        f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (copy {copy_bw / 1e9:.1f}, read {read_bw / 1e9:.1f})"
    )
    if args.only in (None, "tiny"):
        bench(
            "tiny MoE",
            "tiny",
            batch=64,
            new_tokens=64,
            repeats=args.repeats,
            bandwidth=bandwidth,
            engines=args.engines,
            general=args.general,
        )
    if args.only in (None, "smollm2", "smollm2-16"):
        bench(
            "SmolLM2", "smollm2", batch=16, new_tokens=32, repeats=args.repeats, bandwidth=bandwidth,
            engines=args.engines, general=args.general,
        )  # fmt: skip
    if args.only in (None, "smollm2", "smollm2-1"):
        bench(
            "SmolLM2",
            "smollm2",
            batch=1,
            new_tokens=32,
            repeats=args.repeats,
            bandwidth=bandwidth,
            mixed=False,
            general=args.general,
        )


if __name__ == "__main__":
    main()
