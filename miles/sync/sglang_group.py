"""SGLang's weight-update group: the trainer (rank 0) broadcasts every tensor to the servers'
ranks over `torch.distributed` (NCCL on GPU, gloo on CPU), one tensor per broadcast, in the
order of the names it sent in `POST /update_weights_from_distributed`.

The group is made the way SGLang makes it (`init_custom_process_group`: a TCP rendezvous at
`tcp://master_address:master_port`, its store prefixed by that address, a process group of its
own beside any default group), so the trainer's side here joins a real SGLang server's group,
and `miles serve` uses the same function for its side.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_NAME = "weight_update_group"  # SGLang's default


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 600.0
):
    """A process group of `world_size` members meeting at `init_method` (blocks until all join);
    a group of the same name this process had is left first."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    for old, name in list(
        _world.pg_names.items()
    ):  # formed again (a trainer restarted): the new one replaces it
        if name == group_name:
            dist.destroy_process_group(old)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = PrefixStore(init_method, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), prefix_store, group_name=group_name, backend_options=None,
        timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_tensors(group, tensors: Iterable[torch.Tensor]) -> int:
    """Rank 0: each tensor in order; returns the bytes sent."""
    sent = 0
    for t in tensors:
        t = t.detach().contiguous()
        dist.broadcast(t, src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def receive_tensors(
    group, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device | str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """A receiving rank: the tensors rank 0 broadcasts, as (name, tensor) in order."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        dist.broadcast(t, src=0, group=group)
        out.append((name, t))
    return out
