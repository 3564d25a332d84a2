"""An agent's first move, read from and shaped in its language model.

An environment that names its action tokens (Kuhn Poker: "0" pass, "1" bet) lets miles read a
policy exactly, as the probability of each action token at the end of a prompt, and warm a
model up so that its moves start spread over those tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def by_length(tokenizer, prompts: list[str]) -> list[tuple[list[int], torch.Tensor]]:
    """The prompts encoded and grouped by token count: (their indices, a (n, length) batch). Equal
    lengths need no padding, so each row's last position is its prompt's end."""
    groups: dict[int, tuple[list[int], list[list[int]]]] = {}
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(p)
        index, rows = groups.setdefault(len(ids), ([], []))
        index.append(i)
        rows.append(ids)
    return [(index, torch.tensor(rows)) for index, rows in groups.values()]


def warm_up_actions(
    policy, tokenizer, prompts: list[str], actions: tuple[str, ...], steps: int, lr: float
) -> float:
    """Supervised steps toward the uniform distribution over the action tokens at the end of
    each prompt; returns the probability mass left outside them (at the worst prompt)."""
    ids = [tokenizer.encode(a)[0] for a in actions]
    batches = [x for _, x in by_length(tokenizer, prompts)]
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy.train()
    for _ in range(steps):
        loss = sum(-F.log_softmax(policy(x).logits[:, -1], -1)[:, ids].mean(-1).sum() for x in batches)
        opt.zero_grad()
        (loss / len(prompts)).backward()
        opt.step()
    policy.eval()
    with torch.no_grad():
        mass = torch.cat([policy(x).logits[:, -1].softmax(-1)[:, ids].sum(-1) for x in batches])
    return 1.0 - float(mass.min())


def read_policy(policy, tokenizer, prompts: list[str], actions: tuple[str, str]) -> list[float]:
    """At each prompt, the probability that the response starts with the second action token:
    exactly the behaviour policy when every other token counts as the first action."""
    b = tokenizer.encode(actions[1])[0]
    out = [0.0] * len(prompts)
    with torch.no_grad():
        for index, x in by_length(tokenizer, prompts):
            for i, p in zip(index, policy(x).logits[:, -1].softmax(-1)[:, b].tolist()):
                out[i] = p
    return out
