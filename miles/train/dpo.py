"""`miles dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs.

Pairs come from a JSONL/Parquet file with TRL's column names (`prompt`, `chosen`, `rejected`;
strings), or are built from a reasoning-gym task so the result is checkable here: the chosen
answer is the task's, the rejected one a wrong number near it. The reference log-probs of each
pair are computed once, the first time the pair is drawn: by a frozen copy of the starting
policy, or with LoRA by the policy with its adapters off (the base). Held-out task accuracy
(greedy, scored by the task) is measured every --eval-every steps; metrics.jsonl in --output-dir
holds TRL's `rewards/*` figures, the loss and that accuracy, for `miles plot`.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from miles.algo.preference import LOSS_TYPES, preference_loss, sequence_logps
from miles.data.prompts import PromptItem, default_job_task_config, read_records, task_prompts
from miles.data.sample import Sample
from miles.diagnostics.metrics_file import MetricsLogger
from miles.errors import ConfigError
from miles.lora.adapters import DEFAULT_TARGETS, LoraSpec, add_adapters, disabled, parse_targets
from miles.lora.peft_files import export_lora
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.models.tokenizer import encode_prompt
from miles.rewards.runner import RewardRunner
from miles.train.batch import forward_logprobs, pack_samples
from miles.train.sft import greedy_accuracy


@dataclass
class PairRunConfig:
    """What `miles dpo` and `miles rm` share: the model, the pairs, the loop, where results go."""

    model: str = "tiny"
    task: str | None = "basic_arithmetic"
    task_config: dict | None = None  # default: the default job's problems
    data: str | None = None  # JSONL/Parquet with prompt, chosen, rejected (replaces --task)
    chat: bool = True
    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-4
    seed: int = 0
    eval_every: int = 50
    eval_size: int = 200
    output_dir: str = "runs/dpo"
    save: str | None = None


@dataclass
class DPOConfig(PairRunConfig):
    beta: float = 0.1
    loss_type: str = "sigmoid"
    length_normalize: bool = False
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_target_modules: str = ",".join(DEFAULT_TARGETS)


@dataclass
class Pair:
    prompt: str | list[dict[str, str]]
    chosen: str
    rejected: str


def task_pairs(task: str, size: int, seed: int, config: dict) -> tuple[list[Pair], object]:
    """`size` problems of a task, each with its answer chosen and a wrong number near it rejected."""
    items, dataset = task_prompts(task, size, seed, config)
    rng = random.Random(seed)
    pairs = []
    for item in items:
        try:
            answer = int(str(item.label).strip())
        except ValueError as e:
            raise ConfigError(
                f"--task {task}: its answers are not integers ({item.label!r}); give --data pairs"
            ) from e
        wrong = answer + rng.choice([d for d in range(-10, 11) if d])
        pairs.append(Pair(item.prompt, str(answer), str(wrong)))
    return pairs, dataset


def file_pairs(path: str) -> list[Pair]:
    records = read_records(path, "--data")
    missing = [k for k in ("prompt", "chosen", "rejected") if records and k not in records[0]]
    if missing:
        raise ConfigError(
            f"--data {path}: records need TRL's columns prompt, chosen, rejected; missing {missing}"
        )
    return [Pair(r["prompt"], str(r["chosen"]), str(r["rejected"])) for r in records]


def response_sample(prompt_ids: list[int], answer: str, tokenizer) -> Sample:
    ids = tokenizer(answer, add_special_tokens=False).input_ids
    ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return Sample(tokens=prompt_ids + ids, response_length=len(ids))


def pair_logps(
    model, pairs: list[Pair], tokenizer, chat: bool, average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs of `pairs` under `model`: one packed forward."""
    samples = []
    for which in ("chosen", "rejected"):
        for p in pairs:
            samples.append(
                response_sample(encode_prompt(tokenizer, p.prompt, chat), getattr(p, which), tokenizer)
            )
    batch = pack_samples(samples).to(model.lm_head.weight.device)
    logp = forward_logprobs(model, batch).logprobs
    seq = sequence_logps(logp, batch.response_mask, average)
    return seq[: len(pairs)], seq[len(pairs) :]


def run_dpo(cfg: DPOConfig) -> dict:
    if cfg.loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss-type {cfg.loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    torch.manual_seed(cfg.seed)
    model, tokenizer = registry.load(cfg.model, seed=cfg.seed)
    config = cfg.task_config if cfg.task_config is not None else default_job_task_config()
    held: list[PromptItem] = []
    dataset = None
    if cfg.data:
        pairs = file_pairs(cfg.data)
    elif cfg.task:
        pairs, dataset = task_pairs(cfg.task, min(20_000, cfg.steps * cfg.batch_size), cfg.seed, config)
        if cfg.eval_size:
            held, _ = task_prompts(cfg.task, cfg.eval_size, cfg.seed + 10_007, config)
    else:
        raise ConfigError("miles dpo needs --task or --data")
    if not pairs:
        raise ConfigError(f"--data {cfg.data}: no pairs")
    average = cfg.length_normalize or cfg.loss_type == "ipo"
    if cfg.lora_rank:
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
        add_adapters(
            model, LoraSpec(cfg.lora_rank, alpha, targets=parse_targets(cfg.lora_target_modules)), cfg.seed
        )
        reference, ref_off = model, lambda: disabled(model)  # the base: adapters off
    else:
        reference, ref_off = copy.deepcopy(model).eval().requires_grad_(False), contextlib.nullcontext
    rewards = RewardRunner("auto", None, False, 30.0, dataset)
    metrics = MetricsLogger(_run_dir(cfg.output_dir))
    metrics.archive_previous()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    refs: dict[int, tuple[float, float]] = {}  # pair index -> reference (chosen, rejected) log-probs
    acc = float("nan")
    try:
        if held:
            acc = greedy_accuracy(model.eval(), tokenizer, held, cfg.chat, rewards)
            metrics.log(-1, {"eval_accuracy": acc})
        bar = tqdm(range(cfg.steps), desc="miles dpo", unit="step")
        t0 = time.perf_counter()
        for step in bar:
            idx = rng.sample(range(len(pairs)), min(cfg.batch_size, len(pairs)))
            batch = [pairs[i] for i in idx]
            new = [i for i in idx if i not in refs]
            if new:
                with torch.no_grad(), ref_off():
                    reference.eval()
                    c, r = pair_logps(reference, [pairs[i] for i in new], tokenizer, cfg.chat, average)
                refs.update({i: (float(a), float(b)) for i, a, b in zip(new, c, r)})
            model.train()
            chosen, rejected = pair_logps(model, batch, tokenizer, cfg.chat, average)
            ref_chosen = torch.tensor([refs[i][0] for i in idx], device=chosen.device)
            ref_rejected = torch.tensor([refs[i][1] for i in idx], device=chosen.device)
            loss, record = preference_loss(
                chosen, rejected, ref_chosen, ref_rejected, cfg.beta, cfg.loss_type
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            record["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(trainable, 1.0))
            opt.step()
            record.update(loss=loss.item(), step_time=time.perf_counter() - t0)
            t0 = time.perf_counter()
            if held and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                acc = greedy_accuracy(model.eval(), tokenizer, held, cfg.chat, rewards)
                record["eval_accuracy"] = acc
            metrics.log(step, record)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", margin=f"{record['rewards/margins']:.2f}", eval=f"{acc:.2f}"
            )
        bar.close()
    finally:
        metrics.close()
        rewards.close()
    if cfg.save and cfg.lora_rank:
        export_lora(model.eval(), cfg.save, cfg.model, merged=False, tokenizer=tokenizer)
    elif cfg.save:
        save_model(model.eval(), cfg.save, tokenizer=tokenizer)
    return {
        "steps": cfg.steps,
        "loss": record["loss"],
        "eval_accuracy": acc,
        "run_dir": str(metrics.path.parent),
    }


def _run_dir(path: str) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out
