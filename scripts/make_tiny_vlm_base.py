"""Make the built-in vision-language base (`miles/assets/tiny-vlm-base`) from random weights.

Two stages, as VLMs are made from a pretrained vision encoder. First the vision tower alone learns
to see the squares: a linear probe on its merged tokens predicts the count (`--encoder-steps`);
trained end to end from random weights, the language model never starts to read the image tokens
(measured: held-out accuracy stays at 1 in 4 for 1,000 steps). Then the whole tiny Qwen2-VL
(`tiny-vlm-random`) is fine-tuned on `--task shapes` (count the squares in an image, answer 1-4)
and stopped as soon as its held-out accuracy (greedy, first token) reaches `--target`: a model that has learnt to read the image a little, clearly above the 1 in 4 of a
model that cannot see and clearly below what RL can bring it to. The held-out problems are the
ones `miles train --task shapes` evaluates on (the run's seed + 10,007), never trained on.

    .venv/bin/python scripts/make_tiny_vlm_base.py --out miles/assets/tiny-vlm-base
"""

from __future__ import annotations

import argparse
import random

import torch

from miles.data.images import processor_for, shapes_items
from miles.models import registry
from miles.models.checkpoint import save_model

EVAL_SEED = 10_007  # miles train's held-out draw with the default --seed 0


def encode(items, processor, tokenizer, chat: bool = False):
    """(ids (B, T), answer position mask, pixel_values, grid): prompt + answer + end of turn."""
    rows, pixels, grids, answer_at = [], [], [], []
    for item in items:
        ids, mm = processor(item.prompt, item.images, chat=chat)
        answer = tokenizer(item.label).input_ids + [tokenizer.eos_token_id]
        answer_at.append(len(ids))
        rows.append(ids + answer)
        pixels.append(mm["pixel_values"])
        grids.append(mm["image_grid_thw"])
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    return ids, torch.tensor(answer_at), torch.cat(pixels), torch.cat(grids)


def pretrain_encoder(model, processor, tokenizer, rng: random.Random, steps: int, batch: int) -> None:
    """The vision tower and merger learn to count: a linear probe on the mean of an image's merged
    tokens predicts its count (the probe is thrown away)."""
    probe = torch.nn.Linear(model.config.hidden_size, 17)
    optimizer = torch.optim.AdamW([*model.visual.parameters(), *probe.parameters()], lr=1e-3)
    for step in range(steps):
        items = shapes_items(batch, rng.randrange(2**31), {})
        _, _, pixels, grid = encode(items, processor, tokenizer)
        tokens = model.visual(pixels, grid).view(len(items), -1, model.config.hidden_size)
        loss = torch.nn.functional.cross_entropy(
            probe(tokens.mean(1)), torch.tensor([int(i.label) for i in items])
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            print(f"encoder step {step}: probe loss {loss.item():.3f}", flush=True)


@torch.no_grad()
def accuracy(model, batch, labels) -> float:
    ids, answer_at, pixels, grid = batch
    logits = model(ids, pixel_values=pixels, image_grid_thw=grid).logits
    first = logits[torch.arange(len(ids)), answer_at - 1].argmax(-1)
    return sum(int(f) == int(t) for f, t in zip(first, labels)) / len(labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--target", type=float, default=0.45, help="stop at this held-out accuracy")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--encoder-steps", type=int, default=200, help="vision-tower pretraining steps")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = registry.load("tiny-vlm-random", seed=args.seed)
    processor = processor_for("tiny-vlm-random")
    held = shapes_items(256, EVAL_SEED, {})
    held_batch = encode(held, processor, tokenizer)
    held_labels = [tokenizer(i.label).input_ids[0] for i in held]
    rng = random.Random(args.seed)
    pretrain_encoder(model, processor, tokenizer, rng, args.encoder_steps, args.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        items = shapes_items(args.batch, rng.randrange(2**31), {})
        ids, answer_at, pixels, grid = encode(items, processor, tokenizer)
        logits = model(ids[:, :-1], pixel_values=pixels, image_grid_thw=grid).logits
        targets = ids[:, 1:]
        positions = torch.arange(targets.shape[1])[None]
        mask = (positions >= answer_at[:, None] - 1) & (targets != tokenizer.pad_token_id)
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            acc = accuracy(model, held_batch, held_labels)
            print(f"step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.3f}", flush=True)
            if acc >= args.target:
                break
    save_model(model, args.out, tokenizer)
    print(f"saved {args.out} at step {step}: held-out accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
