"""One rollout: prompts -> groups of samples -> engine -> rewards -> group filters."""

from __future__ import annotations

from collections.abc import Callable

from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem
from miles.data.sample import Sample
from miles.rewards.runner import RewardRunner
from miles.rollout.engine import Engine, Request
from miles.rollout.sampling import SamplingParams


def encode_prompt(tokenizer, prompt, chat: bool) -> list[int]:
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    return tokenizer(str(prompt)).input_ids


def generate_groups(
    engine: Engine,
    items: list[PromptItem],
    cfg: RunConfig,
    rollout_id: int,
    n: int,
    temperature: float,
    seed_base: int,
) -> list[list[Sample]]:
    """n samples per prompt; each request's seed depends on (seed, rollout, index) alone, so a
    resumed run draws exactly what the uninterrupted one would have."""
    r = cfg.rollout
    requests, groups = [], []
    for g, item in enumerate(items):
        ids = encode_prompt(engine.tokenizer, item.prompt, cfg.data.apply_chat_template)
        group = []
        for k in range(n):
            sample = Sample(
                group_index=g,
                index=g * n + k,
                prompt=item.prompt,
                label=item.label,
                metadata=dict(item.metadata),
            )
            params = SamplingParams(
                temperature=temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                max_new_tokens=r.rollout_max_response_len, seed=hash((seed_base, rollout_id, g, k)) % (2**63),
            )  # fmt: skip
            requests.append(Request(ids, params, sample=sample))
            group.append(sample)
        groups.append(group)
    samples = iter(engine.generate(requests))  # the engine's own objects, or copies from a remote one
    return [[next(samples) for _ in group] for group in groups]


def rollout(
    engine: Engine,
    items: list[PromptItem],
    cfg: RunConfig,
    rewards: RewardRunner,
    rollout_id: int,
    keep_group: Callable | None,
) -> tuple[list[list[Sample]], dict[str, float]]:
    r = cfg.rollout
    groups = generate_groups(
        engine, items, cfg, rollout_id, r.n_samples_per_prompt, r.rollout_temperature, r.rollout_seed
    )
    failed = rewards.score_groups(groups)
    samples = [s for g in groups for s in g]
    rewards.check_rollout(failed, len(samples), rollout_id)
    metrics = {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "accuracy": sum(s.reward >= 1.0 for s in samples) / len(samples),
        "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        "truncated_frac": sum(s.status.value == "truncated" for s in samples) / len(samples),
        "reward_failed": failed,
    }
    if keep_group is not None:
        kept = [g for g in groups if keep_group(g)]
        metrics["groups_dropped"] = len(groups) - len(kept)
        groups = kept
    # over-sampling draws extra prompts; the step trains on at most rollout_batch_size of them
    return groups[: cfg.rollout.rollout_batch_size], metrics
