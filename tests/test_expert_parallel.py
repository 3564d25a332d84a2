"""Expert parallelism and expert offload: the same loss and gradients as whole experts.

Spawned gloo ranks check the all-to-all dispatch against one process holding every expert; a
Ray run through `miles train` checks the whole path (sharded training, gathered weights for the
engines and checkpoints, resume)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from miles.train import expert_parallel
from tests.conftest import assert_same_run, free_port, random_model


def batch_for(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 97, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    return ids, mask, torch.randint(0, 97, (3, 11), generator=gen)


def loss_of(model, rank: int) -> torch.Tensor:
    ids, mask, targets = batch_for(rank)
    out = model(ids, attention_mask=mask)
    per_token = F.cross_entropy(out.logits.transpose(1, 2), targets, reduction="none")
    return (per_token * mask).sum() / mask.sum()


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def ep_worker(rank: int, world: int, size: int, port: int, offload: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        full = random_model("qwen3_moe", num_experts=4).train()
        ref = copy.deepcopy(full)  # one process, every expert: the sum of every rank's loss
        ref_losses = [loss_of(ref, r) for r in range(world)]
        sum(ref_losses).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))

        model = copy.deepcopy(full)
        if offload:  # as the trainer prepares it: experts to host memory, then sharded
            from miles.train.expert_offload import offload_experts

            loader = offload_experts(model)
        ep = expert_parallel.setup(model, rank, world, size)
        assert expert_bytes(model) * size == expert_bytes(full)
        loss = loss_of(model, rank)
        torch.testing.assert_close(loss, ref_losses[rank], atol=1e-5, rtol=1e-5)
        (loss * world).backward()
        assert expert_parallel.all_reduce_gradients(model, ep, True)
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
        if offload:
            assert loader.resident == 0 and 0 < loader.peak <= expert_bytes(model) * 2 // len(
                full.model.layers
            )
        norm = expert_parallel.clip_grad_norm(model, ep, float("inf"))
        torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
        whole = expert_parallel.gather_state(model, ep)
        if rank == 0:
            assert whole.keys() == full.state_dict().keys()
            assert all(torch.equal(whole[k], v) for k, v in full.state_dict().items())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,size,offload", [(2, 2, False), (4, 2, False), (2, 2, True)])
def test_expert_parallel_equals_whole_experts(world, size, offload):
    """EP=2 over 2 ranks, EP=2 x DP=2 over 4, and EP=2 with --offload-experts: each rank's loss,
    every gradient (dense and expert) and the gradient norm equal one process with every expert
    (within 1e-5); a rank holds 1/size of the expert bytes (offloaded: at most one expert's
    weights at a time on the compute device); the gathered state is the whole model."""
    mp.spawn(ep_worker, args=(world, size, free_port(), offload), nprocs=world)


def test_expert_parallel_in_miles_train_matches_the_local_run_and_resumes(ray_cluster, tmp_path, local_run):
    """--expert-model-parallel-size 2 on 2 training ranks: the same metrics as one process, the
    engines receive the gathered experts (--check-weight-update-equal), a checkpoint holds every
    rank's optimizer state and a resumed run goes on as the uninterrupted one; each rank's expert
    weights are half of the model's."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from tests.conftest import small_run_args

    ep = [
        "--actor-num-gpus-per-node",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--check-weight-update-equal",
    ]
    ep += ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    train(load_config(small_run_args(tmp_path / "ep", 1) + ep))
    train(load_config(small_run_args(tmp_path / "ep", 2) + ep + ["--load", str(tmp_path / "ckpt")]))
    # expert parallelism runs every sample (its forwards are collective), so the reference does too:
    # the MoE load metrics then count the same tokens
    local, split = local_run(2, "--no-skip-zero-advantage"), read_metrics(tmp_path / "ep")
    assert_same_run(local, split)
    trained = [(a, b) for a, b in zip(local, split) if "mem_train_weights_gb" in b]
    for a, b in trained:  # the load metrics are counted over both ranks
        assert b["expert_load_max_over_mean"] == pytest.approx(a["expert_load_max_over_mean"])
        # a rank holds the dense part and half of the experts (most of this model's bytes)
        assert b["mem_train_weights_gb"] < 0.7 * b["mem_rollout_weights_float32_gb"]
    assert trained


def test_offloaded_experts_give_identical_numerics_and_bounded_residency():
    """--offload-experts: the same loss and gradients as experts in place (bitwise), and never more
    than one expert's weights resident on the compute device, none after the step."""
    from miles.train.expert_offload import expert_parameters, offload_experts

    full = random_model("qwen2_moe", num_hidden_layers=3).train()
    ref = copy.deepcopy(full)
    loss_ref = loss_of(ref, 0)
    loss_ref.backward()
    loader = offload_experts(full)
    loss = loss_of(full, 0)
    loss.backward()
    assert torch.equal(loss, loss_ref)
    grads = dict(ref.named_parameters())
    for name, p in full.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    one_expert = sum(
        p.numel() * 4 for n, p in expert_parameters(full) if ".experts.0." in n and "layers.0." in n
    )
    assert 0 < loader.peak <= one_expert
    assert loader.resident == 0
