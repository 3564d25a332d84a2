"""Expert parallelism: each MoE layer's experts split over N training ranks.

Ranks form groups of N consecutive ranks (`ep_group`); rank i of a group holds experts
[i E/N, (i+1) E/N) of every MoE layer, the rest of the model whole. A forward routes its own
tokens, then:

    dispatch   all-to-all: each (token, slot) row goes to the rank holding its expert
    compute    every local expert on the rows it received, from all N ranks
    combine    all-to-all back, weighted, summed into the tokens

(`all_to_all_single` over torch.distributed: gloo has it on CPU, NCCL on GPU.) The backward of
each all-to-all is the all-to-all in the other direction, so an expert's gradient collects every
token of its group that used it. Gradients are then summed: the dense part over all ranks, each
expert over the ranks holding the same experts (`expert_dp_group`); both are divided by the
world size, the data-parallel average. Every rank runs the same number of forwards (each MoE
layer's all-to-all is a collective), so the trainer packs whole micro-batches without the
shared-prompt split.

Weights keep their Hugging Face names (`experts` becomes a ModuleDict keyed by the global
expert index), so a rank's state dict is the slice of the whole one; `gather_state` rebuilds
the whole for checkpoints and weight sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from miles.errors import ConfigError


class AllToAll(torch.autograd.Function):
    """Rows `x` split by `send` go to each rank; the rows received (split by `recv`) come back.
    The gradient travels the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


@dataclass
class ExpertParallel:
    """This rank's place in expert parallelism (shared by every MoE layer of the model)."""

    size: int
    rank: int  # index within the expert-parallel group
    ep_group: object  # the N ranks that split the experts
    expert_dp_group: object  # the ranks holding the same experts as this one
    world: int

    def __deepcopy__(self, memo):  # a copied model (the reference) shares the process groups
        return self

    def local_experts(self, n_experts: int) -> list[int]:
        per = n_experts // self.size
        return list(range(self.rank * per, (self.rank + 1) * per))

    def dispatch(self, moe, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor):
        """The MoE layer's routed output (N, hidden) with experts on their ranks."""
        E, N = moe.num_experts, self.size
        per = E // N
        order = expert.argsort(stable=True)  # by expert, hence by destination rank
        token = token[order]
        counts = torch.bincount(expert, minlength=E).view(N, per)  # my slots per (rank, its expert)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # (source rank, my expert)
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()
        rows = AllToAll.apply(x.index_select(0, token), send, recv, self.ep_group)
        # received rows come by source rank, then expert: regroup them by expert
        local = torch.arange(per, device=x.device).repeat(N).repeat_interleave(received.reshape(-1))
        regroup = local.argsort(stable=True)
        y = moe.run_experts(rows[regroup], received.sum(0).tolist(), self.local_experts(E))
        y = y[regroup.argsort()]
        y = AllToAll.apply(y, recv, send, self.ep_group) * weight[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)


def check_experts(model: nn.Module, size: int) -> None:
    n = getattr(model.config, "num_experts", 0) or 0
    if not n:
        raise ConfigError(f"--expert-model-parallel-size {size}: the model has no MoE layers to split")
    if n % size:
        raise ConfigError(
            f"--expert-model-parallel-size {size} must divide the model's {n} experts; use one of "
            f"{[d for d in range(1, n + 1) if n % d == 0]}"
        )


def make_groups(rank: int, world: int, size: int) -> tuple[object, object]:
    """(expert-parallel group, expert-data-parallel group) of `rank`; every rank must call this."""
    ep_group = dp_group = None
    for g in range(world // size):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            ep_group = group
    for i in range(size):
        ranks = list(range(i, world, size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return ep_group, dp_group


def shard_experts(model: nn.Module, ep: ExpertParallel) -> nn.Module:
    """Keep this rank's experts of every MoE layer (in place; returns the model)."""
    for module in model.modules():
        if hasattr(module, "expert_parallel"):
            keep = ep.local_experts(module.num_experts)
            module.experts = nn.ModuleDict({str(e): module.experts[e] for e in keep})
            module.expert_parallel = ep
    return model


def setup(model: nn.Module, rank: int, world: int, size: int) -> ExpertParallel:
    """Groups and sharding for --expert-model-parallel-size `size` (a collective: every rank calls it)."""
    check_experts(model, size)
    ep_group, dp_group = make_groups(rank, world, size)
    ep = ExpertParallel(size, rank % size, ep_group, dp_group, world)
    shard_experts(model, ep)
    return ep


def is_expert(name: str) -> bool:
    return ".experts." in name


def all_reduce_gradients(model: nn.Module, ep: ExpertParallel, finite: bool) -> bool:
    """Dense gradients summed over all ranks, expert gradients over the ranks holding the same
    experts, both divided by the world size; True only if every rank's loss was finite."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flag = torch.tensor([0.0 if finite else 1.0], device=named[0][1].device)
    for part, group in (
        ([p for n, p in named if not is_expert(n)], None),
        ([p for n, p in named if is_expert(n)], ep.expert_dp_group),
    ):
        if not part:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in part]
        # reduced on the compute device: offloaded experts' gradients live in host memory (NCCL
        # reduces device tensors only), and go back there
        flat = torch.cat([g.reshape(-1).to(flag.device) for g in grads] + ([flag] if group is None else []))
        if group is None or dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        if group is None:
            flag = flat[-1:].clone()
        flat /= ep.world
        offset = 0
        for p, g in zip(part, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(p.device, copy=True)
            offset += g.numel()
    return bool(flag[0] == 0)


def clip_grad_norm(model: nn.Module, ep: ExpertParallel, max_norm: float) -> torch.Tensor:
    """The whole model's gradient norm (dense part once, every expert once) and clipping by it."""
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    zero = torch.zeros((), device=named[0][1].grad.device)
    dense = sum((p.grad.float().pow(2).sum().to(zero.device) for n, p in named if not is_expert(n)), zero)
    experts = sum((p.grad.float().pow(2).sum().to(zero.device) for n, p in named if is_expert(n)), zero)
    dist.all_reduce(experts, group=ep.ep_group)
    total = (dense + experts).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for _, p in named:
        p.grad.mul_(coef.to(p.grad.device))
    return total


def gather_state(model: nn.Module, ep: ExpertParallel) -> dict[str, torch.Tensor] | None:
    """The whole model's state on rank 0 of the world (every rank must call; others get None):
    rank 0's own tensors plus the experts of the other ranks of its expert-parallel group."""
    own = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    experts = {k: v for k, v in own.items() if is_expert(k)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, experts)
    if dist.get_rank() != 0:
        return None
    whole = dict(own)
    for part in parts[: ep.size]:
        whole.update(part)
    return whole


def gather_optimizer(optimizer: torch.optim.Optimizer, ep: ExpertParallel) -> list[dict]:
    """Each expert-parallel rank's optimizer state (their parameter lists have the same layout),
    gathered on every rank; index i belongs to expert-parallel rank i."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, _cpu(optimizer.state_dict()))
    return parts[: ep.size]


def own_slice(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The entries of a whole state dict this rank holds."""
    names = model.state_dict().keys()
    return {k: state[k] for k in names}


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_cpu(v) for v in x]
    return x
