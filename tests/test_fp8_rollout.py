"""FP8 quantization (miles.quant.fp8) hand-checked, and the FP8 rollout engine's layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.errors import ConfigError
from miles.quant.convert import skip_patterns, to_fp8
from miles.quant.fp8 import (
    E4M3_MAX,
    FP8Recipe,
    block_amax,
    dequantize,
    fake_quantize,
    fake_quantize_activation,
    quantize,
    underflow_fraction,
)
from miles.quant.fp8_linear import FP8Linear, FP8Spec
from tests.conftest import random_model

BLOCK, TENSOR = FP8Recipe("blockwise"), FP8Recipe("tensorwise")
SPEC = FP8Spec("blockwise")


def test_blockwise_scales_by_hand_with_a_partial_block():
    x = torch.zeros(130, 3)  # rows 128..129 form a partial block below the first
    x[5, 1] = 896.0  # block (0, 0): amax 896 -> scale 2 (already a power of two)
    x[129, 2] = -3.0  # block (1, 0): amax 3 -> 3/448, rounded up to 2**-7
    codes, scale = quantize(x, BLOCK)
    assert scale.shape == (2, 1)
    assert scale[0, 0] == 2.0 and scale[1, 0] == 2.0**-7
    assert codes[5, 1].float() == 448.0  # the block's amax maps to E4M3's largest value
    assert codes[129, 2].float() == -384.0  # -3 / 2**-7 = -384 is exact in E4M3
    _, fp32 = quantize(x, FP8Recipe("blockwise", fp32_scales=True))
    assert torch.allclose(fp32[1, 0], torch.tensor(3.0 / 448))
    assert torch.equal(block_amax(x, 128), torch.tensor([[896.0], [3.0]]))


def test_e4m3_saturates_at_448_and_keeps_codes_finite():
    x = torch.tensor([[1000.0, -1000.0, 1.0]])
    codes, scale = quantize(x, FP8Recipe("tensorwise", fp32_scales=True))
    assert codes.float().abs().max() == E4M3_MAX and torch.isfinite(codes.float()).all()
    assert torch.allclose(dequantize(codes, scale, TENSOR)[0, :2], torch.tensor([1000.0, -1000.0]))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), seed=st.integers(0, 1000), fp32=st.booleans())
def test_fake_quantize_error_is_bounded_by_e4m3_precision(rows, cols, seed, fp32):
    """Relative error of a value near its block's amax is at most half an E4M3 step (2**-4)."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    recipe = FP8Recipe("blockwise", fp32_scales=fp32)
    q = fake_quantize(x, recipe)
    big = x.abs() >= block_amax(x, 128).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols] / 2
    assert ((q - x).abs()[big] <= x.abs()[big] * 2.0**-4 + 1e-12).all()
    assert torch.equal(fake_quantize(q, recipe), q)  # quantizing twice changes nothing


def test_an_outlier_flushes_a_tensorwise_tensor_but_not_other_blocks():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[0, 0] = 1e4  # one outlier in block (0, 0)
    tensorwise, blockwise = underflow_fraction(x, TENSOR), underflow_fraction(x, BLOCK)
    assert tensorwise > 0.9 and blockwise < 0.3  # 3 of 4 blocks never see the outlier


def test_activation_tiles_are_per_token():
    x = torch.tensor([[1.1, 2.3], [1e5, 3.0]])
    tiled = fake_quantize_activation(x, BLOCK)
    assert torch.allclose(tiled[0], x[0], rtol=2**-4)  # row 0 keeps its own scale
    whole = fake_quantize_activation(x, TENSOR)  # the outlier token's scale for every token
    assert (whole[0] - x[0]).abs().max() > 0.1


def test_fp8_linear_quantizes_both_operands_and_follows_weight_updates():
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 150)
    layer = FP8Linear(linear, SPEC)
    x = torch.randn(4, 200)

    def expected():
        return F.linear(fake_quantize_activation(x, BLOCK), fake_quantize(linear.weight, BLOCK), linear.bias)

    with torch.no_grad():
        assert torch.equal(layer(x), expected())
        linear.weight.mul_(2.0)  # what an optimizer step does: an in-place update
        assert torch.equal(layer(x), expected())


def test_rollout_model_swaps_projections_only():
    model = random_model("qwen3_moe")
    swapped = to_fp8(model, SPEC)
    assert swapped and all(n.endswith("_proj") for n in swapped)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], FP8Linear) for n in swapped)
    assert not isinstance(modules["model.layers.0.mlp.gate"], FP8Linear)  # the router
    assert not isinstance(model.lm_head, FP8Linear)


def test_skip_layers_keep_full_precision_and_typos_are_errors():
    model = random_model("qwen3_moe")
    swapped = to_fp8(model, SPEC, skip_patterns("experts, o_proj"))
    assert swapped and not any("experts" in n or "o_proj" in n for n in swapped)
    with pytest.raises(ConfigError, match="'expertz' matches no layer"):
        to_fp8(random_model("qwen3_moe"), SPEC, skip_patterns("expertz"))


def test_fp32_scales_come_from_the_environment(monkeypatch):
    from miles.config import load_config

    assert not load_config(["--fp8-rollout-only"]).precision.fp8_fp32_scales
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    cfg = load_config(["--fp8-rollout-only"])
    assert cfg.precision.fp8_fp32_scales and cfg.precision.fp8_recipe == "blockwise"
