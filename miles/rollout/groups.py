"""One rollout: prompts -> groups of samples -> engine -> rewards -> group filters (the
held-out evaluation, `miles.rollout.evaluation`, generates through the same path).

`mode` (`miles.agents.modes.RolloutMode`, None: one engine call per sample) turns each request
into its samples: a multi-turn mode runs whole conversations, and a black-box agent that forks
yields one sample per branch."""

from __future__ import annotations

from collections.abc import Callable

from miles.algo.filters import apply_filter
from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem
from miles.data.sample import Sample
from miles.data.trajectory import AGENT_ERROR, agent_metrics
from miles.errors import MilesError
from miles.models.tokenizer import encode_prompt
from miles.rewards.runner import RewardRunner
from miles.rewards.shaping import shape_overlong
from miles.rollout.sampling import Request, SamplingParams


def group_requests(
    engine,
    item: PromptItem,
    cfg: RunConfig,
    rollout_id: int,
    g: int,
    n: int,
    temperature: float,
    seed_base: int,
    mode=None,
) -> list[Request]:
    """The n requests of prompt `item`, group `g` of its rollout; each seed depends on (seed,
    rollout, group, index) alone, so a resumed run draws exactly what the uninterrupted one would."""
    rollout_cfg = cfg.rollout
    chat = cfg.data.apply_chat_template
    tokenizer = engine.tokenizer
    images = None
    if item.images:  # one processor call: the ids with the images' tokens, and their pixels
        from miles.data.images import blank_images, processor_for

        pictures = blank_images(item.images) if cfg.debug.debug_blank_images else item.images
        sglang = cfg.sglang.rollout_backend == "sglang"  # its servers take the images themselves
        ids, images = processor_for(cfg.model.model, sglang)(item.prompt, pictures, chat)
    elif mode is None:
        ids = encode_prompt(tokenizer, item.prompt, chat)
    else:
        ids = mode.prompt_ids(tokenizer, item.prompt, chat)
    requests = []
    for k in range(n):
        sample = Sample(prompt=item.prompt, label=item.label, metadata=dict(item.metadata))
        params = SamplingParams(
            temperature=temperature, top_p=rollout_cfg.rollout_top_p, top_k=rollout_cfg.rollout_top_k,
            max_new_tokens=rollout_cfg.rollout_max_response_len, seed=hash((seed_base, rollout_id, g, k)) % (2**63),
        )  # fmt: skip
        sample.multimodal_train_inputs = images
        requests.append(Request(ids, params, sample=sample, images=images))
    return requests


def generate_groups(
    engine,
    items: list[PromptItem],
    cfg: RunConfig,
    rollout_id: int,
    n: int,
    temperature: float,
    seed_base: int,
    mode=None,
) -> list[list[Sample]]:
    """n samples per prompt (more where an agent forked), in prompt order."""
    groups = [
        group_requests(engine, item, cfg, rollout_id, g, n, temperature, seed_base, mode)
        for g, item in enumerate(items)
    ]
    requests = [r for g in groups for r in g]
    if mode is None:  # the engine's own objects, or copies from a remote one
        each = iter([s] for s in engine.generate(requests))
    else:
        each = iter(mode.generate_each(engine, requests))
    return [[s for _ in group for s in next(each)] for group in groups]


def score_and_filter(
    groups: list[list[Sample]],
    cfg: RunConfig,
    rewards: RewardRunner,
    rollout_id: int,
    keep_group: Callable | None,
) -> tuple[list[list[Sample]], dict[str, float]]:
    """Rewards, the rollout's metrics, and the --dynamic-sampling-filter-path filter."""
    errors = sum(s.metadata.get("finish") == AGENT_ERROR for g in groups for s in g)
    if errors:  # a generation that raised leaves its group without a usable sample
        groups = [g for g in groups if all(s.metadata.get("finish") != AGENT_ERROR for s in g)]
        if not groups:
            raise MilesError(
                f"every sample of rollout {rollout_id} failed to generate ({errors}); the first error is logged above"
            )
    failed = rewards.score_groups(groups)
    samples = [s for g in groups for s in g]
    rewards.check_rollout(failed, len(samples), rollout_id)
    # the task's, before any shaping (a reward model's scores are a proxy: the task's own verdict counts)
    accuracy = sum(s.correct for s in samples) / len(samples)
    shaped = {}
    if buffer := cfg.reward.overlong_buffer_len:
        shaped = shape_overlong(
            samples, cfg.rollout.rollout_max_response_len, buffer, cfg.reward.overlong_penalty_factor
        )
    metrics = {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "accuracy": accuracy,
        **shaped,
        "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        "truncated_frac": sum(s.status.value == "truncated" for s in samples) / len(samples),
        "reward_failed": failed,
        **agent_metrics(samples),
    }
    if errors:
        metrics["agent_errors"] = errors
    if keep_group is not None:
        groups, metrics["groups_dropped"] = apply_filter(groups, keep_group)
    # over-sampling draws extra prompts; the step trains on at most rollout_batch_size of them
    return groups[: cfg.rollout.rollout_batch_size], metrics


def collect_groups(
    engine,
    items: list[PromptItem],
    cfg: RunConfig,
    rewards: RewardRunner,
    rollout_id: int,
    keep_group: Callable | None,
    mode=None,
) -> tuple[list[list[Sample]], dict[str, float]]:
    rollout_cfg = cfg.rollout
    groups = generate_groups(
        engine,
        items,
        cfg,
        rollout_id,
        rollout_cfg.n_samples_per_prompt,
        rollout_cfg.rollout_temperature,
        rollout_cfg.rollout_seed,
        mode,
    )
    return score_and_filter(groups, cfg, rewards, rollout_id, keep_group)
