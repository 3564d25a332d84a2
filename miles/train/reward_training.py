"""`miles rm`: a Bradley-Terry reward model trained on preference pairs.

The pairs are `miles dpo`'s (a TRL-format file, or built from a task: its answer chosen, a wrong
number rejected). The model starts from the policy's checkpoint with a zero scalar head
(`miles.rewards.reward_model`); the loss is -log sigmoid(r(chosen) - r(rejected)), each reward
the head at the sequence's last token (the response's EOS). `eval_pairwise_accuracy` is the
share of held-out pairs (other problems of the task) whose chosen answer scores higher. The
saved checkpoint is what `--rm-type model --rm-path DIR` scores rollouts with.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from miles.data.prompts import default_job_task_config
from miles.diagnostics.metrics_file import MetricsLogger
from miles.errors import ConfigError
from miles.models import registry
from miles.models.tokenizer import encode_prompt
from miles.rewards.reward_model import save_reward_model, sequence_rewards, with_score_head
from miles.train.dpo import Pair, PairRunConfig, file_pairs, response_sample, task_pairs


@dataclass
class RMConfig(PairRunConfig):
    steps: int = 600
    lr: float = 1e-3
    eval_every: int = 100
    eval_size: int = 200  # held-out pairs (with --data: kept out of the file's pairs)
    output_dir: str = "runs/rm"


def pair_rewards(model, pairs: list[Pair], tokenizer, chat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards of `pairs`, one forward over both."""
    sequences = []
    for which in ("chosen", "rejected"):
        for p in pairs:
            prompt = encode_prompt(tokenizer, p.prompt, chat)
            sequences.append(response_sample(prompt, getattr(p, which), tokenizer).tokens)
    r = sequence_rewards(model, sequences)
    return r[: len(pairs)], r[len(pairs) :]


@torch.no_grad()
def pairwise_accuracy(model, pairs: list[Pair], tokenizer, chat: bool, batch: int = 64) -> float:
    """The share of pairs whose chosen response scores higher (a tie counts half)."""
    wins = 0.0
    for i in range(0, len(pairs), batch):
        chosen, rejected = pair_rewards(model, pairs[i : i + batch], tokenizer, chat)
        wins += float((chosen > rejected).sum() + 0.5 * (chosen == rejected).sum())
    return wins / len(pairs)


def run_rm(cfg: RMConfig) -> dict:
    torch.manual_seed(cfg.seed)
    model, tokenizer = registry.load(cfg.model, seed=cfg.seed)
    model = with_score_head(model)
    config = cfg.task_config if cfg.task_config is not None else default_job_task_config()
    if cfg.data:
        pairs = file_pairs(cfg.data)
        random.Random(cfg.seed).shuffle(pairs)
        held, pairs = pairs[: cfg.eval_size], pairs[cfg.eval_size :]
    elif cfg.task:
        pairs, _ = task_pairs(cfg.task, min(20_000, cfg.steps * cfg.batch_size), cfg.seed, config)
        held = task_pairs(cfg.task, cfg.eval_size, cfg.seed + 10_007, config)[0] if cfg.eval_size else []
    else:
        raise ConfigError("miles rm needs --task or --data")
    if not pairs:
        raise ConfigError(f"miles rm: no training pairs ({len(held)} held out: give a smaller --eval-size)")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLogger(out)
    metrics.archive_previous()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    acc = float("nan")
    try:
        if held:
            acc = pairwise_accuracy(model.eval(), held, tokenizer, cfg.chat)
            metrics.log(-1, {"eval_pairwise_accuracy": acc})
        bar = tqdm(range(cfg.steps), desc="miles rm", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            batch = rng.sample(pairs, min(cfg.batch_size, len(pairs)))
            model.train()
            chosen, rejected = pair_rewards(model, batch, tokenizer, cfg.chat)
            loss = -F.logsigmoid(chosen - rejected).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, 1.0))
            opt.step()
            record = {
                "loss": loss.item(), "accuracy": float((chosen > rejected).float().mean()),
                "reward_margin": float((chosen - rejected).detach().mean()), "grad_norm": grad_norm,
                "step_time": time.perf_counter() - t0,
            }  # fmt: skip
            if held and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                acc = record["eval_pairwise_accuracy"] = pairwise_accuracy(
                    model.eval(), held, tokenizer, cfg.chat
                )
            metrics.log(step, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", eval=f"{acc:.2f}")
        bar.close()
    finally:
        metrics.close()
    if cfg.save:
        save_reward_model(model.eval(), cfg.save, tokenizer)
    return {"steps": cfg.steps, "loss": record["loss"], "eval_pairwise_accuracy": acc, "run_dir": str(out)}
