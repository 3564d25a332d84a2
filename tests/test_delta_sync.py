"""Delta weight sync: a chain of deltas lands the trainer's weights bit for bit, and a delta that
does not apply is refused and replaced by a full version."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles.models.checkpoint import hf_state_dict
from miles.rollout import Engine
from miles.sync.delta import DeltaDecoder, DeltaEncoder, DeltaRefused
from tests.conftest import random_model


def train_a_little(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a random next-token loss: every weight moves by a few ulps or more."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=gen)
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    ).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltas_land_the_full_weights_bitwise(dtype):
    trainer = random_model("qwen3", seed=1)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    engine_model = random_model("qwen3", seed=9)  # different weights until the first sync
    engine = Engine(engine_model, max_batch_size=2, max_seq_len=32)
    encoder, decoder = DeltaEncoder(dtype), DeltaDecoder()
    full_bytes = sum(t.numel() * dtype.itemsize for t in hf_state_dict(trainer).values())
    kinds = []
    for version in range(1, 6):
        delta = encoder.encode(hf_state_dict(trainer).items(), version)
        kinds.append(delta.base)
        engine.update_weights([(n, t.float()) for n, t in decoder.apply(delta)], version=version)
        want = {n: t.to(dtype).float() for n, t in hf_state_dict(trainer).items()}
        got = hf_state_dict(engine_model)
        assert all(torch.equal(got[n], want[n]) for n in want)  # bit for bit, every version
        if version > 1:
            assert delta.moved_bytes < full_bytes  # a delta is smaller than the weights
        train_a_little(trainer, opt, version)
    assert kinds == [None, 1, 2, 3, 4]  # one full version, then a chain of deltas


def test_a_corrupted_delta_is_refused_and_a_full_version_repairs_it():
    trainer = random_model("qwen3", seed=1)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoder.apply(encoder.encode(hf_state_dict(trainer).items(), 1))
    train_a_little(trainer, opt, 0)
    delta = encoder.encode(hf_state_dict(trainer).items(), 2)
    first = delta.tensors[0]
    flipped = bytearray(first.payload)
    flipped[len(flipped) // 2] ^= 0xFF
    bad = dataclasses.replace(
        delta, tensors=(dataclasses.replace(first, payload=bytes(flipped)), *delta.tensors[1:])
    )
    before = {n: t.clone() for n, t in decoder.state.items()}
    with pytest.raises(DeltaRefused):
        decoder.apply(bad)
    assert decoder.version == 1 and all(torch.equal(before[n], decoder.state[n]) for n in before)  # untouched
    with pytest.raises(DeltaRefused, match="version"):  # a delta on a version this receiver never had
        decoder.apply(dataclasses.replace(delta, base=7))
    encoder.reset()  # what a refusal asks of the sender
    full = encoder.encode(hf_state_dict(trainer).items(), 2)
    assert full.base is None
    got = dict(decoder.apply(full))
    assert all(torch.equal(got[n], t) for n, t in hf_state_dict(trainer).items())


def test_changed_fraction_counts_changed_elements():
    encoder = DeltaEncoder()
    w = torch.zeros(1000)
    encoder.encode([("w", w)], 1)
    w[:37] = 1.0
    assert encoder.encode([("w", w)], 2).changed_fraction == pytest.approx(0.037)
    assert encoder.encode([("w", w)], 3).changed_fraction == 0.0
