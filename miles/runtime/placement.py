"""Where the Ray actors go: one placement group reserving a bundle per device.

A bundle is one device: {"GPU": 1, "CPU": 1} on a GPU cluster, {"CPU": 1} (one process) on CPU.
Training ranks take the first `actor_num_nodes * actor_num_gpus_per_node` bundles, rollout
engines the next `rollout_num_gpus` (disaggregated). With `--colocate` the engines share the
training ranks' bundles, each side asking for a fraction of the device, and the idle side gives
its memory back while the other works (see `miles.runtime.feed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.errors import MilesError
from miles.sync.group import free_port

COLOCATED_SHARE = 0.5  # of a bundle's device, for each of the two colocated actors


@dataclass(frozen=True)
class Layout:
    """Bundle indices of each training rank and each engine, and the share of its bundle each
    actor asks for (1.0 alone, COLOCATED_SHARE when two actors share a device)."""

    num_bundles: int
    train_bundles: list[int]
    rollout_bundles: list[int]
    share: float


def plan_layout(train_ranks: int, engines: int, colocate: bool) -> Layout:
    if colocate:
        if engines != train_ranks:
            raise MilesError(
                f"--colocate runs one engine on each training device: --rollout-num-gpus ({engines}) must equal "
                f"--actor-num-nodes x --actor-num-gpus-per-node ({train_ranks})"
            )
        ranks = list(range(train_ranks))
        return Layout(train_ranks, ranks, ranks, COLOCATED_SHARE)
    return Layout(
        train_ranks + engines,
        list(range(train_ranks)),
        list(range(train_ranks, train_ranks + engines)),
        1.0,
    )


@dataclass
class Placement:
    """A ready placement group and the options that put an actor in a given bundle."""

    group: object
    layout: Layout
    use_gpu: bool

    def options(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        share = self.layout.share
        return {
            "num_cpus": share,
            "num_gpus": share if self.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
        }

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def free_address() -> tuple[str, int]:
    """This node's IP and a free port (run on the node of a process group's rank 0)."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def rendezvous(options: dict) -> tuple[str, int]:
    """A `torch.distributed` rendezvous address on the node an actor with `options` will run on
    (several nodes: not the driver's)."""
    import ray

    if sum(node["Alive"] for node in ray.nodes()) == 1:  # one node: the driver's; no task process to start
        return free_address()
    where = {k: v for k, v in options.items() if k == "scheduling_strategy"}
    return ray.get(ray.remote(num_cpus=0)(free_address).options(**where).remote())


def ensure_ray(num_bundles: int) -> None:
    """Start a local Ray if none is running; its logical CPU count fits the bundles (on CPU a
    bundle is a process, not a core, so 2 ranks + 2 engines run on a 2-core machine)."""
    import os

    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=max(os.cpu_count() or 1, num_bundles),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


def create_placement(layout: Layout, device: str = "cpu", timeout_s: float = 60.0) -> Placement:
    """Reserve the bundles (PACK: as few nodes as possible) or fail naming what is missing.
    Bundles hold a GPU each when `device` (--device) is cuda, or auto on a cluster with GPUs."""
    import logging

    import ray
    from ray.util.placement_group import placement_group

    ensure_ray(layout.num_bundles)
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if device == "cuda" and not has_gpu:
        raise MilesError("--device cuda: the Ray cluster has no GPUs; use --device cpu or auto")
    use_gpu = has_gpu and device in ("cuda", "auto")
    if has_gpu and not use_gpu:
        logging.getLogger("miles").warning(
            "the Ray cluster has GPUs but --device is cpu: models compute on CPU; pass --device cuda (or auto) "
            "to use them"
        )
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(layout.num_bundles)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise MilesError(
            f"could not reserve {layout.num_bundles} x {bundle} on the Ray cluster in {timeout_s:.0f} s "
            f"(it has {ray.cluster_resources()}): lower --actor-num-gpus-per-node / --rollout-num-gpus, "
            "use --colocate, or add nodes"
        ) from e
    return Placement(group, layout, use_gpu)
