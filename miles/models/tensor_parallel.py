"""Tensor parallelism for inference (Megatron style): one model split over `world` processes.

Each rank keeps a slice of every attention head group and every MLP/expert inner dimension:
q/k/v, gate and up projections are split by output rows ("column parallel"), o_proj and
down_proj by input columns ("row parallel"). A layer's attention and MLP/MoE outputs are then
partial sums, added up by one all-reduce each; embeddings, norms, routers and lm_head stay whole,
so every rank holds the same hidden states, routes tokens to the same experts and samples the
same tokens. Weights keep their Hugging Face names and full shapes on the wire: `shard` cuts a
full tensor into this rank's slice, `unshard` puts slices back together.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from miles.errors import MilesError
from miles.models.transformer import Transformer

COLUMN = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")  # split dim 0 (weight, bias)
ROW = (".o_proj.", ".down_proj.")  # weight split dim 1; bias kept by rank 0 only


def split_dim(name: str) -> int | None:
    """0 or 1 for a sliced tensor, None for one every rank holds whole."""
    if any(k in name for k in COLUMN):
        return 0
    if any(k in name for k in ROW) and name.endswith(".weight"):
        return 1
    return None


def check_divisible(model: Transformer, world: int) -> None:
    cfg = model.config
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % world}
    if bad:
        raise MilesError(
            f"--rollout-num-gpus-per-engine {world}: the model's {bad} do not split into {world} equal parts; "
            f"use a size that divides them"
        )


def shard(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of the full HF tensor `name`."""
    dim = split_dim(name)
    if dim is not None:
        return tensor.chunk(world, dim=dim)[rank].contiguous()
    if any(k in name for k in ROW) and name.endswith(".bias") and rank > 0:
        return torch.zeros_like(tensor)  # a row-parallel bias is added once, after the sum
    return tensor


def shard_named(
    named: Iterable[tuple[str, torch.Tensor]], rank: int, world: int
) -> list[tuple[str, torch.Tensor]]:
    return [(name, shard(name, t, rank, world)) for name, t in named]


def unshard(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's part (rank order)."""
    dim = split_dim(name)
    return torch.cat(list(parts), dim=dim) if dim is not None else parts[0]


def _reduce_output(group):
    def hook(module, args, output):
        if isinstance(output, tuple):  # MoE: (out, router logits, experts)
            dist.all_reduce(output[0], group=group)
            return output
        dist.all_reduce(output, group=group)
        return output

    return hook


def shard_model(model: Transformer, rank: int, world: int, group=None) -> Transformer:
    """Turn a whole model into this rank's tensor-parallel part (in place; returns it).

    Needs `torch.distributed` initialised with the `world` ranks of this engine (`group`)."""
    check_divisible(model, world)
    full = dict(model.state_dict())
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            for pname in ("weight", "bias"):
                p = getattr(module, pname)
                if p is None:
                    continue
                name = f"{module_name}.{pname}"
                setattr(
                    module,
                    pname,
                    torch.nn.Parameter(shard(name, full[name], rank, world), requires_grad=False),
                )
            module.out_features, module.in_features = module.weight.shape
    cfg = copy.copy(model.config)
    cfg.num_attention_heads //= world
    cfg.num_key_value_heads //= world
    model.config = cfg
    for layer in model.model.layers:
        layer.self_attn.n_heads //= world
        layer.self_attn.n_kv //= world
        layer.self_attn.register_forward_hook(_reduce_output(group))
        layer.mlp.register_forward_hook(_reduce_output(group))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
