"""Gumbel noise drawn ahead: a block of rows per engine slot, each from its request's generator.

Sampling draws one row of noise per request and step from that request's own generator
(`sampling.gumbel_noise`), which at a small vocabulary is mostly per-call cost: 64 generator
calls a step for the tiny MoE at batch 64. A generator's `uniform_` over an (R, V) block gives
the numbers R successive (V,) draws give, and the transform is elementwise, so drawing R rows at
once changes no token and no log-prob (tests/test_noise_bank.py).

Only for plain decoding: speculative decoding draws from the same generators in between.
"""

from __future__ import annotations

import torch

BUDGET_BYTES = 32 * 2**20  # the bank's size at most (slots x rows x vocab fp32)
MAX_ROWS = 16  # rows drawn ahead per slot at most


def gumbel_(u: torch.Tensor) -> torch.Tensor:
    """u ~ U(0, 1) -> -log(-log(u)), in place (at a 49k vocabulary every temporary is megabytes)."""
    return u.clamp_(min=1e-20).log_().neg_().log_().neg_()


def rows_ahead(slots: int, vocab: int) -> int:
    """Rows per slot that fit the budget (1: no gain, draw as needed)."""
    return max(1, min(MAX_ROWS, BUDGET_BYTES // (4 * slots * vocab)))


class NoiseBank:
    """Per-slot blocks of uniform draws; `take` hands out each slot's next row as Gumbel noise
    (transformed once per step on the rows taken, not per slot as they are drawn: the same
    numbers in five operations a step instead of five per slot that ran out)."""

    def __init__(self, slots: int, vocab: int) -> None:
        self.rows = rows_ahead(slots, vocab)
        self.bank = torch.empty(slots, self.rows, vocab)
        self.next = [self.rows] * slots  # each slot's next unused row (rows: none left)

    def reset(self, slot: int) -> None:
        """A new request took the slot: its rows come from the new generator."""
        self.next[slot] = self.rows

    def take(self, slots: list[int], generators: list[torch.Generator], left: list[int]) -> torch.Tensor:
        """(len(slots), vocab) noise: each slot's next row, drawn ahead from its generator when
        its block is used up (at most `left` rows: the tokens the request may still sample)."""
        rows, nxt = self.rows, self.next
        for slot, gen, n in zip(slots, generators, left):
            if nxt[slot] == rows:
                n = max(1, min(rows, n))
                self.bank[slot, rows - n :].uniform_(generator=gen)
                nxt[slot] = rows - n
        picked = []
        for slot in slots:
            picked.append(slot * rows + nxt[slot])
            nxt[slot] += 1
        return gumbel_(self.bank.view(-1, self.bank.shape[-1]).index_select(0, torch.tensor(picked)))
