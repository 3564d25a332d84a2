"""Sampling noise drawn ahead (miles/rollout/noise.py) gives the numbers drawn as needed."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.rollout import Engine, Request, SamplingParams
from miles.rollout.noise import NoiseBank, rows_ahead
from miles.rollout.sampling import gumbel_noise
from tests.conftest import random_model


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.integers(1, 300),
    takes=st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True), st.integers(0, 20))
    ),
)
def test_bank_rows_are_each_generators_next_draws(vocab, takes):
    """Any order of takes over any slots, with any `left` (an under-estimate only draws again
    sooner): each slot's rows are its generator's successive gumbel_noise rows."""
    bank = NoiseBank(4, vocab)
    mine = [torch.Generator().manual_seed(s) for s in range(4)]
    oracle = [torch.Generator().manual_seed(s) for s in range(4)]
    for slots, left in takes:
        got = bank.take(slots, [mine[s] for s in slots], [left] * len(slots))
        want = gumbel_noise([oracle[s] for s in slots], vocab)
        assert torch.equal(got, want)


def test_a_new_request_in_a_slot_starts_from_its_own_generator():
    bank = NoiseBank(2, 10)
    old = torch.Generator().manual_seed(1)
    bank.take([0], [old], [5])  # draws 5 rows ahead, uses one
    bank.reset(0)
    new, oracle = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert torch.equal(bank.take([0], [new], [5]), gumbel_noise([oracle], 10))


def test_rows_ahead_stays_within_the_budget():
    assert rows_ahead(64, 260) == 16
    assert rows_ahead(256, 151_936) == 1  # a large vocabulary at many slots: no bank
    assert 4 * 16 * rows_ahead(16, 49_152) * 49_152 <= 32 * 2**20


def test_engine_tokens_and_logprobs_do_not_change_with_the_bank():
    """Mixed temperatures (greedy included), top-k, top-p and lengths, more requests than
    slots: the same tokens and log-probs with noise drawn ahead as drawn step by step."""
    model = random_model("qwen3_moe", seed=3)
    requests = [
        Request(
            [5 + i, 6, 7],
            SamplingParams(
                temperature=[1.0, 0.7, 0, 1.3][i % 4],
                top_k=[-1, 5][i % 2],
                top_p=[1.0, 0.9, 1.0][i % 3],
                max_new_tokens=3 + (i * 7) % 23,
            ),
        )
        for i in range(14)
    ]
    ahead = Engine(copy.deepcopy(model), max_batch_size=5, max_seq_len=64, seed=1)
    as_needed = Engine(model, max_batch_size=5, max_seq_len=64, seed=1)
    assert ahead.sampler.noise is not None and ahead.sampler.noise.rows > 1
    as_needed.sampler.noise = None
    got, want = ahead.generate(copy.deepcopy(requests)), as_needed.generate(copy.deepcopy(requests))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert [s.rollout_log_probs for s in got] == [s.rollout_log_probs for s in want]


def test_gumbel_noise_is_the_per_request_draw():
    """In place and in one buffer, but the same numbers as -log(-log(rand)) per generator."""
    gens = [torch.Generator().manual_seed(s) for s in (3, 1, 4)]
    copies = [torch.Generator().manual_seed(s) for s in (3, 1, 4)]
    got = gumbel_noise(gens, 50)
    want = torch.stack([-torch.log(-torch.log(torch.rand(50, generator=g).clamp(min=1e-20))) for g in copies])
    assert torch.equal(got, want)
