"""Supervised fine-tuning on (prompt, answer) pairs: the base model of the default job, and
(later) draft models. Cross-entropy on the response tokens only; the answer ends with EOS."""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from miles.data.prompts import PromptItem, file_prompts, task_prompts
from miles.data.sample import Sample
from miles.errors import ConfigError
from miles.lora.adapters import (
    DEFAULT_TARGETS,
    LoraSpec,
    add_adapters,
    merge_and_unload,
    parse_targets,
    spec_of,
)
from miles.lora.peft_files import export_lora
from miles.models import registry
from miles.models.checkpoint import save_model
from miles.models.tokenizer import encode_prompt
from miles.rewards.runner import RewardRunner
from miles.rollout.engine import Engine
from miles.rollout.sampling import Request, SamplingParams
from miles.train.batch import forward_logprobs, pack_samples


@dataclass
class SFTConfig:
    model: str = "tiny-random"
    task: str | None = None
    task_config: dict | None = None
    data: str | None = None
    input_key: str = "input"
    label_key: str = "label"
    chat: bool = True
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    eval_every: int = 100
    eval_size: int = 200
    target_accuracy: float | None = None  # stop once held-out accuracy reaches this
    save: str | None = None
    log: str | None = None  # JSONL of (step, loss, eval accuracy)
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank over the frozen model
    lora_alpha: float | None = None  # default 2 x rank
    lora_target_modules: str = ",".join(DEFAULT_TARGETS)


def sft_samples(items: list[PromptItem], tokenizer, chat: bool) -> list[Sample]:
    eos = tokenizer.eos_token_id
    out = []
    for item in items:
        prompt = encode_prompt(tokenizer, item.prompt, chat)
        answer = tokenizer(str(item.label), add_special_tokens=False).input_ids + (
            [eos] if eos is not None else []
        )
        out.append(
            Sample(
                prompt=item.prompt,
                tokens=prompt + answer,
                response_length=len(answer),
                label=item.label,
                metadata=dict(item.metadata),
            )
        )
    return out


def greedy_accuracy(model, tokenizer, items: list[PromptItem], chat: bool, rewards: RewardRunner) -> float:
    """Share of held-out prompts whose greedy answer the run's reward scores 1 (the RL loop's
    definition of correct)."""
    served = copy.deepcopy(model)
    if spec_of(served) is not None:  # the engine serves base + adapter merged, as in RL
        merge_and_unload(served)
    engine = Engine(served, tokenizer, max_batch_size=128, max_seq_len=256)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    samples = engine.generate(
        [
            Request(
                encode_prompt(tokenizer, i.prompt, chat),
                params,
                sample=Sample(label=i.label, metadata=dict(i.metadata)),
            )
            for i in items
        ]
    )
    rewards.score_groups([[s] for s in samples])
    return sum(s.reward >= 1.0 for s in samples) / len(samples)


def run_sft(cfg: SFTConfig) -> dict:
    torch.manual_seed(cfg.seed)
    model, tokenizer = registry.load(cfg.model, seed=cfg.seed)
    if cfg.task:
        pool = min(
            100_000, cfg.steps * cfg.batch_size
        )  # as many problems as the run can draw (making one costs)
        items, dataset = task_prompts(cfg.task, pool, cfg.seed, cfg.task_config or {})
        held = []
        if cfg.eval_size:
            held, _ = task_prompts(cfg.task, cfg.eval_size, cfg.seed + 10_007, cfg.task_config or {})
    elif cfg.data:
        items = file_prompts(cfg.data, cfg.input_key, cfg.label_key, None, "--data")
        random.Random(cfg.seed).shuffle(items)
        held, items, dataset = items[: cfg.eval_size], items[cfg.eval_size :], None
    else:
        raise ConfigError("miles sft needs --task or --data")
    if not items:
        raise ConfigError(
            f"miles sft: no training records: all {len(held)} went to the held-out set (--eval-size "
            f"{cfg.eval_size}); give a smaller --eval-size (0: no held-out set)"
        )
    rewards = RewardRunner("auto", None, False, 30.0, dataset)  # the task's scorer, else exact match
    if cfg.lora_rank:
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
        add_adapters(
            model, LoraSpec(cfg.lora_rank, alpha, targets=parse_targets(cfg.lora_target_modules)), cfg.seed
        )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(cfg.seed)
    history = []
    log_file = Path(cfg.log).open("w") if cfg.log else None
    bar = tqdm(range(1, cfg.steps + 1), desc="miles sft", unit="step")
    t0 = time.perf_counter()
    acc = float("nan")
    for step in bar:
        batch = pack_samples(
            sft_samples(rng.sample(items, min(cfg.batch_size, len(items))), tokenizer, cfg.chat)
        )
        batch = batch.to(model.lm_head.weight.device)
        logp = forward_logprobs(model, batch).logprobs
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        record = {"step": step, "loss": loss.item(), "time": time.perf_counter() - t0}
        if held and (step % cfg.eval_every == 0 or step == cfg.steps):
            model.eval()
            acc = greedy_accuracy(model, tokenizer, held, cfg.chat, rewards)
            model.train()
            record["eval_accuracy"] = acc
        history.append(record)
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        bar.set_postfix(loss=f"{record['loss']:.3f}", eval_acc=f"{acc:.2f}")
        if cfg.target_accuracy is not None and record.get("eval_accuracy", -1) >= cfg.target_accuracy:
            break
    bar.close()
    if cfg.save and cfg.lora_rank:  # the PEFT adapter (load it with --lora-adapter-path, or peft)
        export_lora(model.eval(), cfg.save, cfg.model, merged=False, tokenizer=tokenizer)
    elif cfg.save:
        save_model(model.eval(), cfg.save, tokenizer=tokenizer)
    return {"steps": len(history), "loss": history[-1]["loss"], "eval_accuracy": acc}
