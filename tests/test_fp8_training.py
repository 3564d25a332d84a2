"""Unified FP8: trainer and engine quantize identically, the STE and the gradient formats, the
train/rollout mismatch table, the outlier symptom and its remedy, the precision warm-up."""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F

from miles.algo.mismatch import importance_weights
from miles.quant.convert import fp8_layers, set_mode, to_fp8, weight_bytes
from miles.quant.fp8 import FP8Recipe, fake_quantize, fake_quantize_activation, quantize, underflow_fraction
from miles.quant.fp8_linear import FP8Linear, FP8Spec, _RoundSTE, scaled_mm
from tests.conftest import random_model, response_logprobs

SPEC = FP8Spec("blockwise")


def test_trainer_and_engine_quantize_bit_identically_and_the_engine_stores_fp8():
    base = random_model("qwen3_moe", hidden_size=256, moe_intermediate_size=192)
    trainer, engine = copy.deepcopy(base), copy.deepcopy(base)
    to_fp8(trainer, SPEC)
    to_fp8(engine, SPEC, store_codes=True)
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(trainer(ids).logits, engine(ids).logits)
    # the dtype check: the engine's projection weights are float8; the trainer keeps fp32 masters
    layers = fp8_layers(engine)
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(m.weight.dtype == torch.float32 for m in fp8_layers(trainer))
    stored, fp32 = weight_bytes(engine)
    assert stored <= 0.27 * fp32


def test_the_straight_through_estimator_passes_the_gradient_unchanged():
    x = torch.randn(5, 300, requires_grad=True)
    upstream = torch.randn(5, 300)
    _RoundSTE.apply(x, lambda t: fake_quantize_activation(t, SPEC.inputs)).backward(upstream)
    assert torch.equal(x.grad, upstream)


def _weight_grad(fmt: str, linear: torch.nn.Linear, x: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    layer = FP8Linear(copy.deepcopy(linear), FP8Spec("blockwise", fmt=fmt))
    layer(x).backward(upstream)
    return layer.weight.grad


def test_hybrid_backward_quantizes_gradients_to_e5m2_e4m3_to_e4m3():
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(160, 96), torch.randn(6, 160)
    upstream = torch.randn(6, 96) * torch.logspace(-3, 3, 96)  # a wide range: the formats differ
    xq = fake_quantize_activation(x, SPEC.inputs)
    for fmt, grad_fmt in (("hybrid", "e5m2"), ("e4m3", "e4m3")):
        g = fake_quantize_activation(upstream, FP8Recipe("blockwise", fmt=grad_fmt))
        assert torch.allclose(_weight_grad(fmt, linear, x, upstream), g.t() @ xq, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(
        _weight_grad("hybrid", linear, x, upstream), _weight_grad("e4m3", linear, x, upstream)
    )


def test_e5m2_keeps_range_e4m3_keeps_precision():
    x = torch.tensor([[1.0, 1.0625, 1e-6]])  # 1.0625 needs 3 mantissa bits; 1e-6 of amax needs range
    e4m3 = fake_quantize_activation(x, FP8Recipe("tensorwise", True, "e4m3"))
    e5m2 = fake_quantize_activation(x, FP8Recipe("tensorwise", True, "e5m2"))
    assert e5m2[0, 2] != 0 and e4m3[0, 2] == 0  # E4M3 flushes what E5M2's exponent still holds
    assert e4m3[0, 1] != e4m3[0, 0] and e5m2[0, 1] == e5m2[0, 0]  # E5M2 has fewer mantissa bits


def test_real_scaled_mm_agrees_with_the_emulation():
    torch.manual_seed(0)
    a, b = torch.randn(16, 64), torch.randn(32, 64)
    recipe = FP8Recipe("tensorwise", fp32_scales=True)
    (qa, sa), (qb, sb) = quantize(a, recipe), quantize(b, recipe)
    emulated = fake_quantize(a, recipe) @ fake_quantize(b, recipe).t()
    assert torch.allclose(scaled_mm(qa, sa, qb, sb), emulated, rtol=1e-5, atol=1e-5)


def _mismatch(engine_model, train_model, tokenizer) -> tuple[float, float]:
    """Mean |logp_train - logp_rollout| and the fraction of tokens outside a [0.99, 1/0.99] trust
    band, over the engine's own samples of 16 prompts."""
    from miles.rollout import Engine, Request, SamplingParams

    engine = Engine(engine_model, tokenizer, max_batch_size=16, max_seq_len=64, seed=0)
    prompts = [tokenizer.encode(f"{a} + {b} =") for a, b in zip(range(10, 26), range(40, 56))]
    samples = engine.generate(
        [Request(p, SamplingParams(temperature=1.0, max_new_tokens=12)) for p in prompts]
    )
    trained = response_logprobs(train_model, samples)
    diff = torch.tensor([t - r for s, ts in zip(samples, trained) for t, r in zip(ts, s.rollout_log_probs)])
    band = importance_weights(diff, torch.zeros_like(diff), torch.ones_like(diff), threshold=0.99)
    return float(diff.abs().mean()), float(band.clipfrac)


def test_mismatch_table_unified_fp8_matches_fp32_rollout_only_does_not():
    from miles.models import registry

    policy, tokenizer = registry.load("tiny")
    policy.eval()

    def fp8(model, codes):
        model = copy.deepcopy(model)
        to_fp8(model, SPEC, store_codes=codes)
        return model

    table = {
        "fp32/fp32": _mismatch(copy.deepcopy(policy), policy, tokenizer),
        "fp8/fp8 (unified)": _mismatch(fp8(policy, True), fp8(policy, False), tokenizer),
        "fp8 rollout / fp32 trainer": _mismatch(fp8(policy, True), policy, tokenizer),
    }
    print(json.dumps(table))
    assert table["fp32/fp32"][0] <= 1e-5
    rollout_only, unified = table["fp8 rollout / fp32 trainer"], table["fp8/fp8 (unified)"]
    # Unified is exact where a GEMM's bits do not depend on its row count (the engine decodes a
    # few rows, the trainer runs whole sequences). Where they do (MKL on some CPUs), a one-ulp
    # difference now and then crosses an FP8 rounding boundary: still 100x below rollout-only.
    assert unified[0] <= 2e-3 and rollout_only[0] > 1e-2 and rollout_only[0] >= 100 * unified[0]
    assert rollout_only[1] > 0.01 and rollout_only[1] >= 10 * unified[1]


def test_an_outlier_breaks_tensorwise_scaling_and_blockwise_fp32_scales_keep_it():
    """An FP8 collapse, reproduced: one large weight in each MLP down-projection (on a
    channel that is never active, so the fp32 model does not change) makes a tensorwise scale flush
    the rest of the tensor; blockwise scaling confines the damage to one block."""
    model = random_model("qwen3", hidden_size=512, intermediate_size=1024, num_hidden_layers=2, head_dim=32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(5.0)  # an MLP that matters to the output
            layer.mlp.up_proj.weight[0] = 0.0  # intermediate channel 0 is always 0 ...
            layer.mlp.down_proj.weight[0, 0] = 1e7  # ... so this huge weight changes nothing in fp32
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(1))

    def logprob_gap(spec: FP8Spec) -> float:
        quantized = copy.deepcopy(model)
        to_fp8(quantized, spec)
        with torch.no_grad():
            ref, got = F.log_softmax(model(ids).logits, -1), F.log_softmax(quantized(ids).logits, -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())  # KL(fp32 || fp8) per token

    tensorwise = logprob_gap(FP8Spec("tensorwise"))
    blockwise = logprob_gap(FP8Spec("blockwise", fp32_scales=True))
    print(f"KL(fp32 || fp8) per token: tensorwise {tensorwise:.3g}, blockwise FP32 scales {blockwise:.3g}")
    assert tensorwise > 10 * blockwise and blockwise < 0.02
    down = model.model.layers[0].mlp.down_proj.weight
    assert underflow_fraction(down, FP8Recipe("tensorwise")) > 0.9  # the whole tensor, flushed
    assert underflow_fraction(down, FP8Recipe("blockwise", fp32_scales=True)) < 0.05  # one block of 32


def test_precision_warmup_runs_bf16_then_fp8_in_trainer_and_engine(tmp_path):
    from miles.config import load_config
    from miles.run import train
    from tests.conftest import small_run_args

    out = tmp_path / "warm"
    flags = [
        "--fp8-recipe",
        "blockwise",
        "--warmup-precision",
        "bf16",
        "--warmup-steps",
        "2",
        "--eval-size",
        "0",
    ]
    train(load_config(small_run_args(out, 4) + flags))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["fp8_enabled"] for s in steps] == [0.0, 0.0, 1.0, 1.0]
    # bf16 steps quantize nothing; FP8 steps do; trainer and engine agree throughout, the switch
    # included (an FP8 engine under a full-precision trainer is ~1e-2 apart: see the table above)
    assert [s["fp8_flush_frac"] > 0 for s in steps] == [False, False, True, True]
    assert max(s["train_rollout_logprob_abs_diff"] for s in steps) <= 1e-4


def test_set_mode_converts_an_engine_layer_between_bf16_and_fp8():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    engine_layer = FP8Linear(copy.deepcopy(linear), SPEC, store_codes=True, mode="bf16")
    assert engine_layer.weight.dtype == torch.bfloat16
    set_mode(torch.nn.Sequential(engine_layer), "fp8")
    assert engine_layer.weight.dtype == torch.float8_e4m3fn
    engine_layer.load_weight(linear.weight)
    trainer_layer = FP8Linear(copy.deepcopy(linear), SPEC)
    x = torch.randn(3, 128)
    with torch.no_grad():
        assert torch.equal(engine_layer(x), trainer_layer(x))
