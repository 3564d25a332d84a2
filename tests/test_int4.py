"""INT4: the fake-quant formula by hand, the straight-through gradient, packing, the INT4 kernel
against the fake-quant matmul, the group-size check, the train/rollout mismatch table, and a run
with QAT and its precision warm-up."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.errors import ConfigError
from miles.quant.convert import check_int4_group, set_mode, skip_patterns, to_int4, weight_bytes
from miles.quant.int4 import (
    fake_quantize_int4,
    kernel_matmul,
    pack_int4,
    quantize_int4,
    to_kernel_layout,
    unpack_int4,
)
from miles.quant.int4_linear import Int4Linear
from tests.test_fp8_training import _mismatch


def test_fake_quant_by_hand():
    # group 1: amax 1.4 -> s = 0.2; w/s = 3.1, -7, 0.25, 1.75 -> q = 3, -7, 0, 2
    # group 2: all zero -> s = 1e-5 (the floor), q = 0; group 3: amax 0.07 -> s = 0.01
    w = torch.tensor([[0.62, -1.4, 0.05, 0.35, 0.0, 0.0, 0.0, 0.0, 0.07, -0.031, 0.0149, 0.066]])
    codes, scales = quantize_int4(w, 4)
    assert codes.tolist() == [[3, -7, 0, 2, 0, 0, 0, 0, 7, -3, 1, 7]]
    assert torch.allclose(scales, torch.tensor([[0.2, 1e-5, 0.01]]))
    expected = torch.tensor([[0.6, -1.4, 0.0, 0.4, 0, 0, 0, 0, 0.07, -0.03, 0.01, 0.07]])
    assert torch.allclose(fake_quantize_int4(w, 4), expected, atol=1e-7)


def test_the_straight_through_gradient_is_the_identity():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 16)
    layer = Int4Linear(copy.deepcopy(linear), group=32)
    x, upstream = torch.randn(5, 64), torch.randn(5, 16)
    (layer(x) * upstream).sum().backward()
    # the rounding passes the gradient unchanged: dL/dW = upstream^T x, as for a plain linear
    assert torch.allclose(layer.weight.grad, upstream.t() @ x, atol=1e-5)
    fq = fake_quantize_int4(linear.weight.detach(), 32)
    assert torch.allclose(layer(x), x @ fq.t() + linear.bias, atol=1e-6)  # forward on the grid


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), half_cols=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trips_bit_for_bit(rows, half_cols, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (rows, 2 * half_cols), generator=gen, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, half_cols)  # two codes per byte
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("group", [32, 128])
def test_the_int4_kernel_equals_the_fake_quant_matmul(group):
    torch.manual_seed(group)
    w, x = torch.randn(96, 256) * 0.05, torch.randn(7, 256)
    codes, scales = quantize_int4(w, group)
    packed, scales_and_zeros = to_kernel_layout(codes, scales)
    reference = x @ fake_quantize_int4(w, group).t()
    out = kernel_matmul(x, packed, scales_and_zeros, group)
    assert ((out - reference).norm() / reference.norm()) <= 1e-5
    # an engine layer with bf16 activations holds the kernel's packed weight (1/8 of fp32, plus
    # scales) on the same grid, and runs the kernel: the matmul to bf16 precision
    engine = Int4Linear(torch.nn.Linear(256, 96, bias=False), group, store_packed=True, activations="bf16")
    engine.load_weight(w)
    assert engine.kernel and engine.weight.dtype == torch.uint8 and engine.weight.numel() == w.numel() // 2
    assert torch.equal(engine.dequantized_weight(), fake_quantize_int4(w, group))
    assert ((engine(x) - reference).norm() / reference.norm()) <= 1e-2
    # fp32 activations: two codes per byte, dequantized per forward: the trainer's forward bit for bit
    exact = Int4Linear(torch.nn.Linear(256, 96), group, store_packed=True)
    trainer = Int4Linear(torch.nn.Linear(256, 96), group)
    with torch.no_grad():
        trainer.weight.copy_(w), trainer.bias.copy_(exact.bias)
    exact.load_weight(w)
    assert not exact.kernel and exact.weight.shape == (96, 128)
    assert torch.equal(exact(x), trainer(x))


def test_a_group_size_that_does_not_divide_fails_naming_the_layer_and_what_would():
    from miles.models import registry

    policy, _ = registry.load("tiny")
    with pytest.raises(ConfigError) as e:
        check_int4_group(policy, 256)
    message = str(e.value)
    assert (
        "--int4-group-size 256 does not divide the input size 128 of model.layers.0.self_attn.q_proj"
        in message
    )
    assert "16, 32, 64, 128" in message
    assert len(check_int4_group(policy, 64)) == 4 * (4 + 8 * 3)  # attention + 8 experts x 3, per layer
    with pytest.raises(ConfigError, match="--int4-skip-layers: 'atention' matches no layer"):
        check_int4_group(policy, 64, ("*atention*",))
    # layers that are always full precision may be named (Megatron's "layer_norm" too): nothing changes
    assert len(check_int4_group(policy, 64, skip_patterns("lm_head,embed,layer_norm"))) == 4 * 28
    assert len(check_int4_group(policy, 64, skip_patterns("self_attn"))) == 4 * 24  # the experts only


def test_mismatch_table_qat_with_int4_rollout_matches_fp32_the_half_measures_do_not():
    """The 2x2 table on the same prompts: who quantizes (trainer, engine) against fp32/fp32."""
    from miles.models import registry

    policy, tokenizer = registry.load("tiny")
    policy.eval()

    def int4(model, engine, group=128, activations="fp32"):
        model = copy.deepcopy(model)
        to_int4(model, group, store_packed=engine, activations=activations)
        return model

    table = {
        "fp32 trainer / fp32 rollout": _mismatch(copy.deepcopy(policy), policy, tokenizer),
        "QAT / INT4 rollout": _mismatch(int4(policy, True), int4(policy, False), tokenizer),
        "QAT / fp32 rollout": _mismatch(copy.deepcopy(policy), int4(policy, False), tokenizer),
        "no QAT / INT4 rollout": _mismatch(int4(policy, True), policy, tokenizer),
        "no QAT / INT4 rollout, group 32": _mismatch(int4(policy, True, 32), policy, tokenizer),
        "QAT / INT4 rollout, bf16 kernel activations": _mismatch(
            int4(policy, True, activations="bf16"), int4(policy, False), tokenizer
        ),
    }
    print(json.dumps(table))
    base, unified = table["fp32 trainer / fp32 rollout"][0], table["QAT / INT4 rollout"][0]
    assert unified <= max(2 * base, 1e-4)
    for half in ("QAT / fp32 rollout", "no QAT / INT4 rollout"):
        assert table[half][0] >= 10 * unified and table[half][0] >= 10 * 1e-4
    # smaller groups follow the weights closer: less mismatch without QAT (and more scale bytes)
    assert table["no QAT / INT4 rollout, group 32"][0] < table["no QAT / INT4 rollout"][0]


def test_engine_weight_bytes_are_an_eighth_of_fp32_plus_scales():
    from miles.models import registry

    policy, _ = registry.load("tiny")
    engine = copy.deepcopy(policy)
    to_int4(engine, 128, store_packed=True)
    stored, fp32 = weight_bytes(engine)
    assert stored / fp32 <= 0.15  # 0.5 byte per weight + 8 bytes of scale and zero per 128
    assert stored / (fp32 / 2) <= 0.30  # against bf16


def test_set_mode_converts_an_engine_layer_between_bf16_and_int4():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    engine = Int4Linear(copy.deepcopy(linear), 64, store_packed=True, mode="bf16")
    assert engine.weight.dtype == torch.bfloat16
    set_mode(engine, "int4")
    assert engine.weight.dtype == torch.uint8
    assert torch.equal(
        engine.dequantized_weight(), fake_quantize_int4(linear.weight.detach().bfloat16().float(), 64)
    )


def test_int4_qat_run_with_precision_warmup_keeps_trainer_and_engine_together(tmp_path):
    """--int4-qat through `miles train`: bf16 for the warm-up rollout, then INT4 in both; the
    engine's log-probs stay with the trainer's throughout, and the engine's memory report shows
    packed weights."""
    from miles.config import load_config
    from miles.run import train
    from tests.conftest import small_run_args

    out = tmp_path / "int4"
    flags = ["--int4-qat", "--int4-group-size", "64", "--warmup-precision", "bf16", "--warmup-steps", "1"]
    train(load_config(small_run_args(out, 3) + flags + ["--eval-size", "0"]))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["int4_enabled"] for s in steps] == [0.0, 1.0, 1.0]
    assert max(s["train_rollout_logprob_abs_diff"] for s in steps) <= 1e-4
    last = steps[-1]
    assert last["mem_rollout_weights_uint8_gb"] > 0 and last["mem_train_optimizer_gb"] > 0
    # the engine's projections are packed: its fp32 bytes are only the embeddings, lm_head, norms, router
    assert last["mem_rollout_weights_uint8_gb"] < last["mem_train_weights_gb"] / 8
