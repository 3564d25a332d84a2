"""Speculative decoding against plain decoding in the same engine: same prompts, same seeds, one run.

    .venv/bin/python benchmarks/speculative.py                  # SmolLM2-135M and the tiny MoE
    .venv/bin/python benchmarks/speculative.py --only tiny --sweep

The workload is the tail of an RL rollout: 16 requests (4 prompts x 4 samples, so a prompt's
samples resemble each other) decoding 128 tokens each at temperature 0.7, 1, 4 or 8 at a time.
For each model, batch and draft, tokens/s with speculation against without, the acceptance at
each draft position and tokens per policy pass.
Drafts: eagle (an EAGLE head trained first, as `miles draft` trains one, on the policy's own
samples of other prompts of the same kind: `--eagle-prompts` prompts x 4, `--eagle-epochs`
passes; or the head saved at `--eagle-head`), auto (the policy's first layers) and ngram
(continuations of recent matches). `--sweep`: the lookahead k = 1..8 at batch 1. Each draft is
forced to speculate at every batch to show where it pays; the last row of each batch is what a
run uses: the EAGLE head with adaptive speculation (per batch size, the fastest of plain steps
and lookaheads 1..k, measured as it decodes). The cost columns say why: a draft token's time and a
verification's time, both per policy step of plain decoding at the same batch; speculation pays
when tokens per pass exceed verify + k x draft (plus the acceptance rule's own time).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from miles.config.schema import SpeculativeSection
from miles.models import registry
from miles.models.eagle import EagleHead, load_head, save_head
from miles.rollout import Engine, Request, SamplingParams
from miles.rollout.drafts import EagleDraft, ModelDraft, NgramDraft, auto_draft, parameter_count
from miles.rollout.speculative import Speculator
from miles.runtime.draft_pretrain import recording_engine
from miles.train.draft_trainer import EagleTrainer

REQUESTS = 16  # measured per row of the table: 4 prompts x 4 samples
TEMPERATURE = 0.7


def requests_for(tokenizer, batch: int, new_tokens: int, first: int = 0) -> list[Request]:
    prompts = max(1, batch // 4)  # 4 samples per prompt, as GRPO draws them
    texts = [
        f"Question {i}: what is {i * 7 % 97} plus {i * 13 % 89}? Explain step by step."
        for i in range(first, first + prompts)
    ]
    ids = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=new_tokens, ignore_eos=True)
    return [Request(ids[i % prompts], params) for i in range(batch)]


def trained_eagle(name: str, policy, tokenizer, args, new_tokens: int) -> EagleHead:
    """An EAGLE head trained on the policy's samples of prompts the benchmark does not use (as
    `miles draft` trains one), or the one saved at --eagle-head."""
    saved = Path(args.eagle_head) if args.eagle_head and name == "smollm2" else None
    if saved is not None and saved.exists():
        return load_head(saved, policy)
    engine = recording_engine(policy, tokenizer, 32, 512, seed=1)
    t0 = time.perf_counter()
    samples = engine.generate(
        requests_for(tokenizer, 4 * args.eagle_prompts, new_tokens, first=1000), progress=True
    )
    held = engine.generate(requests_for(tokenizer, 32, new_tokens, first=500))
    trainer = EagleTrainer(EagleHead.for_policy(policy, args.draft_vocab), lambda: policy, replay_windows=0)
    for epoch in range(args.eagle_epochs):
        loss = trainer.train(samples)["draft_sft_loss"]  # each call is a whole pass
        print(f"  eagle pass {epoch + 1}/{args.eagle_epochs}: loss {loss:.3f}", flush=True)
    accepted = trainer.acceptance(held, TEMPERATURE, positions=args.lookahead)
    tokens = sum(s.response_length for s in samples)
    print(
        f"  eagle head trained on {tokens} tokens in {time.perf_counter() - t0:.0f} s; expected acceptance "
        f"by position on held-out prompts {' '.join(f'{a:.2f}' for a in accepted)}"
    )
    if saved is not None:
        save_head(trainer.served(), saved, name)
        print(f"  eagle head saved to {saved}")
    return trainer.served()


def run_once(policy, tokenizer, batch, new_tokens, draft=None, k=3, adaptive=False):
    slots = max(batch, 1)
    spec = None
    if draft == "ngram":
        spec = Speculator(NgramDraft(), k, max_batch=1024, adaptive=adaptive)
    elif isinstance(draft, EagleHead):
        spec = Speculator(EagleDraft(copy.deepcopy(draft)), k, max_batch=1024, adaptive=adaptive)
    elif draft is not None:
        spec = Speculator(ModelDraft(copy.deepcopy(draft), slots, 512), k, max_batch=1024, adaptive=adaptive)
    engine = Engine(policy, tokenizer, max_batch_size=slots, max_seq_len=512, seed=0, speculator=spec)
    engine.generate(requests_for(tokenizer, min(batch, 2), 4))  # warm-up
    if spec is not None:
        spec.take_stats()
    engine.take_times()
    t0 = time.perf_counter()
    samples = engine.generate(requests_for(tokenizer, max(batch, REQUESTS), new_tokens))
    seconds = time.perf_counter() - t0
    tokens = sum(s.response_length for s in samples)
    stats = spec.take_stats() if spec is not None else None
    steps = engine.take_times().decode_steps
    return tokens / seconds, stats, seconds / max(steps, 1)


def describe(stats, plain_step: float) -> str:
    """Acceptance by position, tokens per pass, and a draft token's and a verification's time in
    plain steps."""
    if stats is None or not stats.rows:
        return " | | |"
    by_position = " ".join(f"{a / max(c, 1):.2f}" for a, c in zip(stats.at_position, stats.offered))
    draft = stats.draft_seconds / max(stats.passes * stats.k, 1) / plain_step
    verify = stats.verify_seconds / max(stats.passes, 1) / plain_step
    return f"{by_position} | {stats.emitted / stats.rows:.2f} | {draft:.2f} | {verify:.2f}"


def run(name: str, batches: list[int], new_tokens: int, draft_layers: int, sweep: bool, args) -> None:
    policy, tokenizer = registry.load(name)
    policy.eval()
    print(f"\n{name}: training the EAGLE head")
    eagle = trained_eagle(name, policy, tokenizer, args, new_tokens)
    drafts = {"eagle": eagle, "auto": auto_draft(policy, draft_layers), "ngram": "ngram"}
    share = parameter_count(drafts["auto"]) / parameter_count(policy)
    eagle_share = parameter_count(eagle) / parameter_count(policy)
    print(
        f"\n{name}: auto draft = first {draft_layers} layer(s), {share:.0%} of the policy's parameters; "
        f"eagle head {eagle_share:.1%}, {len(eagle.vocab)} draft tokens\n"
    )
    print(
        f"| batch | draft | plain tok/s | speculative tok/s (k={args.lookahead}) | speedup | acceptance by position "
        "| tokens per pass | draft token / plain step | verification / plain step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        plain, _, step = run_once(policy, tokenizer, batch, new_tokens)
        for label, draft in drafts.items():
            speed, stats, _ = run_once(policy, tokenizer, batch, new_tokens, draft, args.lookahead)
            print(
                f"| {batch} | {label} | {plain:.0f} | {speed:.0f} | {speed / plain:.2f}x | {describe(stats, step)} |",
                flush=True,
            )
        speed, stats, _ = run_once(policy, tokenizer, batch, new_tokens, eagle, args.lookahead, adaptive=True)
        print(
            f"| {batch} | eagle, adaptive | {plain:.0f} | {speed:.0f} | {speed / plain:.2f}x | {describe(stats, step)} |"
        )
    if not sweep:
        return
    print(f"\n{name}, batch 1: lookahead sweep\n")
    print("| k | " + " | ".join(f"{d} tok/s | {d} tokens per pass" for d in drafts) + " |")
    print("|---|" + "---|---|" * len(drafts))
    for k in range(1, 9):
        cells = []
        for draft in drafts.values():
            speed, stats, _ = run_once(policy, tokenizer, 1, new_tokens, draft, k)
            cells.append(f"{speed:.0f} | {stats.emitted / max(stats.rows, 1):.2f}")
        print(f"| {k} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "smollm2"))
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each request decodes")
    parser.add_argument("--batches", default="1,4,8", help="concurrent requests, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="also the lookahead sweep k = 1..8 at batch 1")
    parser.add_argument(
        "--eagle-prompts", type=int, default=384, help="prompts (x 4 samples) the EAGLE head trains on"
    )
    parser.add_argument("--eagle-epochs", type=int, default=4, help="passes of the EAGLE head over them")
    parser.add_argument(
        "--eagle-head",
        help="SmolLM2's EAGLE head: loaded from this file when it exists (written by `miles draft --out FILE` "
        "or an earlier run of this benchmark), else trained here and saved to it",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=SpeculativeSection().draft_vocab_size,
        help="the EAGLE head's vocabulary (as --draft-vocab-size)",
    )
    parser.add_argument("--lookahead", type=int, default=3, help="draft tokens per policy pass (k)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    batches = [int(b) for b in args.batches.split(",")]
    layers = {"smollm2": 2, "tiny": 1}  # the auto draft's depth: about a quarter of the policy
    for name in [args.only] if args.only else list(layers):
        run(name, batches, args.new_tokens, layers[name], args.sweep, args)


if __name__ == "__main__":
    main()
