"""`miles draft`: train an EAGLE head before a run, on the policy's own samples of the run's prompts.

An EAGLE head that starts untrained needs tens of thousands of sampled tokens before its proposals
are accepted often enough to pay; online training (--online-sft-interval) gets there only late in
a short run. Trained here first and passed with --eagle-head, the head speculates well from the
first rollout, and online training keeps it matched to the policy as RL moves it.

The samples are drawn as the run's rollouts draw them (prompts, chat template, temperature,
top-p/k, response length, samples per prompt); the engine records the policy's hidden state of
every sampled token, which is what the head learns from. An eighth of the prompts are held out to
report the expected acceptance at the first draft position before and after training.
"""

from __future__ import annotations

import copy
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
from miles.rollout.speculative import Speculator
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
    head = EagleHead.for_policy(policy, cfg.speculative.draft_vocab_size)
    recorder = Speculator(
        EagleDraft(copy.deepcopy(head), record_features=True), 1, max_batch=0
    )  # plain steps
    engine = Engine(
        policy,
        tokenizer,
        max_batch_size=max(GENERATION_BATCH, rollout.rollout_max_batch_size),
        max_seq_len=max_seq_len,
        seed=rollout.rollout_seed,
        speculator=recorder,
        **rollout.decode_options(),
    )
    n, temperature = rollout.n_samples_per_prompt, rollout.rollout_temperature
    requests = [
        r
        for g, item in enumerate(items)
        for r in group_requests(engine, item, cfg, -1, g, n, temperature, rollout.rollout_seed)
    ]
    start = time.perf_counter()
    samples = engine.generate(requests, progress=True)
    generated = time.perf_counter() - start
    train, held_out = samples[: -held * n], samples[-held * n :]
    trainer = EagleTrainer(head, lambda: policy, cfg.speculative.draft_lr, replay_windows=0)
    before = trainer.acceptance(held_out, max(temperature, 1e-3))
    for epoch in range(epochs):
        loss = trainer.train(train)["draft_sft_loss"]  # each call is one pass over the samples
        print(f"miles draft: pass {epoch + 1}/{epochs}, loss {loss:.3f}", flush=True)
    after = trainer.acceptance(held_out, max(temperature, 1e-3))
    save_head(trainer.served(), out, cfg.model.model)
    return {
        "samples": len(train),
        "tokens": sum(s.response_length for s in train),
        "held_out_acceptance_before": before,
        "held_out_acceptance": after,
        "generate_seconds": generated,
        "train_seconds": time.perf_counter() - start - generated,
    }
