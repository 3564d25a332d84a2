"""Write a copy of a MoE checkpoint whose routers send nearly every token to experts 0 and 1.

The symptom of expert load imbalance, made on purpose: each layer's router rows 0
and 1 gain `strength` times the mean direction of that layer's router inputs (measured on a
short text), so their logits are about `strength` higher than the others' for typical tokens.
`miles doctor` then names expert_imbalance; `--aux-loss-coef` is the remedy it lists.

    python scripts/collapse_router.py tiny /tmp/tiny-collapsed
    miles train --model /tmp/tiny-collapsed --num-rollout 5 --output-dir /tmp/collapsed
    miles doctor /tmp/collapsed
"""

from __future__ import annotations

import argparse

import torch

from miles.models import registry
from miles.models.checkpoint import save_model

TEXT = "What is 12 + 7? Answer: 19. What is 45 - 3? Answer: 42."


def collapse_router(model: str, out: str, strength: float = 20.0) -> str:
    policy, tokenizer = registry.load(model)
    if not policy.config.is_moe:
        raise SystemExit(f"{model} is not a mixture-of-experts model")
    inputs: dict[int, torch.Tensor] = {}
    gates = [layer.mlp.gate for layer in policy.model.layers]

    def keep_input(index: int):
        def hook(module, args, output) -> None:  # returns None: the router's output is unchanged
            inputs[index] = args[0].reshape(-1, args[0].shape[-1]).detach()

        return hook

    hooks = [g.register_forward_hook(keep_input(i)) for i, g in enumerate(gates)]
    with torch.no_grad():
        policy(torch.tensor([tokenizer.encode(TEXT)]))
        for h in hooks:
            h.remove()
        for i, gate in enumerate(gates):
            mean = inputs[i].mean(0)
            gate.weight[:2] += strength * mean / mean.norm() ** 2
    save_model(policy, out, tokenizer)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a MoE model: tiny, or a checkpoint directory")
    parser.add_argument("out", help="where to write the collapsed copy")
    parser.add_argument("--strength", type=float, default=20.0, help="logit advantage of experts 0 and 1")
    args = parser.parse_args()
    print(collapse_router(args.model, args.out, args.strength))
