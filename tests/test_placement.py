"""Bundle layouts of the Ray executor, and fitting filtered groups to the training ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.config import load_config
from miles.errors import ConfigError, MilesError
from miles.runtime.feed import fit_to_ranks
from miles.runtime.placement import plan_layout


def test_disaggregated_layout_gives_every_actor_its_own_bundle():
    layout = plan_layout(train_ranks=2, engines=3, colocate=False)
    assert layout.num_bundles == 5 and layout.share == 1.0
    assert layout.train_bundles == [0, 1] and layout.rollout_bundles == [2, 3, 4]


def test_colocated_layout_shares_each_training_bundle_with_one_engine():
    layout = plan_layout(train_ranks=4, engines=4, colocate=True)
    assert layout.num_bundles == 4 and layout.train_bundles == layout.rollout_bundles == [0, 1, 2, 3]
    # a rank and its engine fit one device together, and no third actor would: the share splits it in two
    assert 2 * layout.share <= 1.0 < 3 * layout.share
    apart = plan_layout(train_ranks=4, engines=4, colocate=False)
    assert apart.num_bundles == 8 and not set(apart.train_bundles) & set(apart.rollout_bundles)
    assert apart.share == 1.0  # disaggregated: every actor has its device to itself
    with pytest.raises(MilesError, match="--rollout-num-gpus \\(3\\) must equal"):
        plan_layout(train_ranks=4, engines=3, colocate=True)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "--actor-num-nodes",
                "2",
                "--global-batch-size",
                "9",
                "--rollout-batch-size",
                "3",
                "--n-samples-per-prompt",
                "3",
            ],
            "must split evenly over the 2 training ranks",
        ),
        (["--colocate", "--async-weight-sync"], "--colocate with --async-weight-sync"),
        (
            ["--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"],
            "--rollout-num-gpus must be 2",
        ),
        (["--actor-num-nodes", "0"], "must be >= 1"),
    ],
)
def test_contradictory_placements_fail_before_any_work(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


@given(
    sizes=st.lists(st.integers(1, 8), max_size=12),
    world=st.integers(1, 4),
)
def test_fit_to_ranks_keeps_the_longest_prefix_that_splits_evenly(sizes, world):
    groups = [[0] * n for n in sizes]
    kept, dropped = fit_to_ranks(groups, world)
    assert kept == groups[: len(kept)] and dropped == len(groups) - len(kept)
    assert sum(map(len, kept)) % world == 0
    for m in range(len(kept) + 1, len(groups) + 1):  # no longer prefix would have split evenly
        assert sum(sizes[:m]) % world != 0


def test_a_cluster_too_small_is_named_in_the_error(ray_cluster):
    import ray

    from miles.runtime.placement import create_placement

    before = set(ray.util.placement_group_table())
    from tests.conftest import RAY_CPUS

    bundles = RAY_CPUS + 2
    with pytest.raises(
        MilesError, match=rf"could not reserve {bundles} x \{{'CPU': 1\}}.*'CPU': {RAY_CPUS}\.0.*--colocate"
    ):
        create_placement(plan_layout(bundles // 2, bundles // 2, colocate=False), timeout_s=2)
    mine = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert mine and all(pg["state"] == "REMOVED" for pg in mine.values())  # nothing left reserved


def test_rendezvous_ports_are_outside_the_ephemeral_range():
    """Ray's workers bind to port 0 and get ephemeral ports; a rendezvous port from that range can
    be taken between picking it and listening on it (seen as EADDRINUSE in a training rank)."""
    import socket
    from pathlib import Path

    from miles.runtime.placement import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < low
        with socket.socket() as sock:
            sock.bind(("", port))  # and it is really free
