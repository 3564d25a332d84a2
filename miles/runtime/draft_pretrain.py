"""`miles draft`: train an EAGLE head before a run, on the policy's own samples of the run's prompts.

An EAGLE head that starts untrained needs tens of thousands of sampled tokens before its proposals
are accepted often enough to pay; online training (--online-sft-interval) gets there only late in
a short run. Trained here first and passed with --eagle-head, the head speculates well from the
first rollout, and online training keeps it matched to the policy as RL moves it.

The samples are drawn as the run's rollouts draw them (prompts, chat template, temperature,
top-p/k, response length, samples per prompt); the engine records the policy's hidden state of
every sampled token, which is what the head learns from. An eighth of the prompts are held out to
report the expected acceptance at each draft position (and the tokens per policy pass it makes
at --spec-lookahead) before and after training.
"""

from __future__ import annotations

import time
from pathlib import Path

from miles.config.schema import RunConfig
from miles.data.run_data import build_data
from miles.errors import ConfigError
from miles.models import registry
from miles.models.eagle import EagleHead, save_head
from miles.models.tokenizer import encode_prompt
from miles.rollout import Engine
from miles.rollout.drafts import EagleDraft
from miles.rollout.groups import group_requests
from miles.rollout.speculative import Speculator, tokens_per_pass_by_position
from miles.train.draft_trainer import EagleTrainer

GENERATION_BATCH = 32  # requests decoding at once while collecting samples (speed only)


def pretrain_eagle(cfg: RunConfig, out: Path, prompts: int, epochs: int) -> dict[str, float]:
    """Sample `prompts` of the run's prompts, train a head `epochs` passes, save it to `out`."""
    data = build_data(cfg)
    items = data.train.items[:prompts]
    held = max(1, len(items) // 8)
    if len(items) < 2:
        raise ConfigError(
            f"--draft-prompts {prompts}: the run has {len(data.train.items)} prompts; need 2 or more"
        )
    policy, tokenizer = registry.load(cfg.model.model)
    policy.eval()
    rollout = cfg.rollout
    prompt_len = max(len(encode_prompt(tokenizer, i.prompt, cfg.data.apply_chat_template)) for i in items)
    max_seq_len = min(
        policy.config.max_position_embeddings, prompt_len + rollout.rollout_max_response_len + 1
    )
    engine = recording_engine(
        policy,
        tokenizer,
        max(GENERATION_BATCH, rollout.rollout_max_batch_size),
        max_seq_len,
        rollout.rollout_seed,
        **rollout.engine_options(),
    )
    n, temperature = rollout.n_samples_per_prompt, rollout.rollout_temperature
    requests = [
        r
        for g, item in enumerate(items)
        for r in group_requests(engine, item, cfg, -1, g, n, temperature, rollout.rollout_seed)
    ]
    start = time.perf_counter()
    samples = engine.generate(requests, progress=cfg.logging.progress)
    generated = time.perf_counter() - start
    train, held_out = samples[: -held * n], samples[-held * n :]
    spec = cfg.speculative
    head = EagleHead.for_policy(policy, spec.draft_vocab_size)
    trainer = EagleTrainer(head, lambda: policy, spec.draft_lr, replay_windows=0)
    sampling = temperature, rollout.rollout_top_k, rollout.rollout_top_p
    before = trainer.acceptance(held_out, *sampling, positions=spec.spec_lookahead)
    for epoch in range(epochs):
        loss = trainer.train(train)["draft_sft_loss"]  # each call is one pass over the samples
        print(f"miles draft: pass {epoch + 1}/{epochs}, loss {loss:.3f}", flush=True)
    after = trainer.acceptance(held_out, *sampling, positions=spec.spec_lookahead)
    save_head(trainer.served(), out, cfg.model.model)
    return {
        "samples": len(train),
        "tokens": sum(s.response_length for s in train),
        "held_out_acceptance_before": before[0],
        "held_out_acceptance": after[0],
        "held_out_acceptance_by_position": [round(a, 4) for a in after],
        "tokens_per_pass": round(tokens_per_pass_by_position(after), 3),
        "generate_seconds": generated,
        "train_seconds": time.perf_counter() - start - generated,
    }


def recording_engine(
    policy, tokenizer, max_batch: int, max_seq_len: int, seed: int, **engine_options
) -> Engine:
    """An engine that decodes plainly and keeps each sampled token's policy feature
    (`Sample.draft_features`): what an EAGLE head trains on."""
    recorder = Speculator(EagleDraft(EagleHead.for_policy(policy, 1), record_features=True), 1, max_batch=0)
    return Engine(
        policy,
        tokenizer,
        max_batch_size=max_batch,
        max_seq_len=max_seq_len,
        seed=seed,
        speculator=recorder,
        **engine_options,
    )
