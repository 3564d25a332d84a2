"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`: two raylets, two node ids): the
placement group spreads over them, the training ranks meet at rank 0's node, weights cross
nodes, and zero-copy sync falls back to the standard sync because handles do not cross hosts."""

from __future__ import annotations

import logging

import pytest
import ray

from tests.conftest import assert_same_run


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's one-node cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_train_like_one_process(two_nodes, tmp_path, monkeypatch, caplog, local_run):
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.models import registry
    from miles.models.checkpoint import hf_state_dict
    from miles.run import train
    from miles.runtime.ray_rollout import RolloutManager
    from miles.runtime.ray_train import RayTrainer
    from tests.conftest import small_run_args

    nodes = []  # the Ray node of every training rank and engine of the latest run

    def where(cls, nodes_of):
        real = cls.__init__

        def capture(self, *args, **kwargs):
            real(self, *args, **kwargs)
            nodes.extend(nodes_of(self))

        monkeypatch.setattr(cls, "__init__", capture)

    where(RayTrainer, lambda t: ray.get([r.node_id.remote() for r in t.ranks]))
    where(RolloutManager, lambda m: m.node_ids())

    reference = local_run(2)
    model_bytes = sum(
        t.numel() * t.element_size() for t in hf_state_dict(registry.model_for("tiny")).values()
    )
    layout = ["--actor-num-nodes", "2", "--rollout-num-gpus", "2", "--check-weight-update-equal"]
    runs = {
        "broadcast": ["--sync-transport", "broadcast"],  # the weight-update group spans both nodes
        "zero_copy": ["--use-zero-copy-sync"],
    }
    for name, extra in runs.items():
        caplog.clear()
        nodes.clear()
        with caplog.at_level(logging.WARNING, logger="miles"):
            train(load_config(small_run_args(tmp_path / name, 2) + layout + extra))
        assert len(nodes) == 4 and len(set(nodes)) == 2  # 2 ranks + 2 engines over both nodes
        got = read_metrics(tmp_path / name)
        assert_same_run(reference, got, rel=1e-3)
        moved = [r["sync_moved_bytes"] for r in got if "sync_moved_bytes" in r]
        assert len(moved) == 2 and all(m >= model_bytes for m in moved)  # bytes, not handles
        fell_back = any("memory handles only open on the host" in r.message for r in caplog.records)
        assert fell_back == (name == "zero_copy")
