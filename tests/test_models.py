"""The miles transformer against transformers (fp32 oracle), KV-cache decoding and routing replay."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles.models import save_model
from miles.models.row_ops import RMSNorm, apply_rope
from tests.conftest import random_model


def hf_from(model, tmp_path):
    save_model(model, tmp_path / "ckpt")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


def padded_batch(vocab: int, lengths: list[int], left: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=gen)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, T - n :] = 1
        else:
            mask[b, :n] = 1
    return ids, mask


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
def test_logits_match_transformers_on_padded_batch(arch, left, tmp_path):
    model = random_model(arch, seed=3)
    hf = hf_from(model, tmp_path)
    ids, mask = padded_batch(model.config.vocab_size, [11, 4, 8], left=left)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - ref[real]).abs().max() < 1e-4
    assert ours[real].std() > 0.1  # a dead model would pass trivially


def test_gradients_match_transformers(arch, tmp_path):
    """Every parameter's gradient of a padded batch's loss equals transformers' (the hand-written
    RMSNorm backward, attention under the additive mask, MoE dispatch)."""
    model = random_model(arch, seed=5)
    hf = hf_from(model, tmp_path)
    ids, mask = padded_batch(model.config.vocab_size, [9, 5, 7], left=False, seed=1)
    weights = torch.randn(
        3, ids.shape[1], model.config.vocab_size, generator=torch.Generator().manual_seed(2)
    )
    real = mask.bool()[..., None]
    (model(ids, attention_mask=mask).logits * weights * real).sum().backward()
    (hf(input_ids=ids, attention_mask=mask).logits * weights * real).sum().backward()
    ours = {name: p.grad for name, p in model.named_parameters()}
    for name in [n for n in ours if ".mlp.experts.0.gate_proj" in n]:  # transformers fuses the experts
        layer = name.split(".mlp.")[0] + ".mlp.experts"
        n = model.config.num_experts
        gate, up, down = (
            torch.stack([ours.pop(f"{layer}.{e}.{proj}.weight") for e in range(n)])
            for proj in ("gate_proj", "up_proj", "down_proj")
        )
        ours[f"{layer}.gate_up_proj"], ours[f"{layer}.down_proj"] = torch.cat([gate, up], dim=1), down
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        ref = theirs[name]
        assert grad is not None and ref is not None, name
        assert (grad - ref).abs().max() <= 1e-4 * ref.abs().max(), name
    assert any(float(g.abs().max()) > 1e-3 for g in ours.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_equals_autograd_of_its_formula(dtype):
    """The hand-written backward (C++ on CPU in fp32, torch operators otherwise) against autograd
    through the formula; a frozen weight gets no gradient computed."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 16, generator=gen) * 3).to(dtype).requires_grad_()
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen))
    grad = torch.randn(6, 5, 16, generator=gen).to(dtype)
    x_ref, w_ref = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    h = x_ref.float()
    ref = w_ref * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ref.backward(grad)
    out = norm(x)
    out.backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # fp32 on CPU: the C++ pass (its own order of summation), else the formula's operators
    assert (out.float() - ref.float()).abs().max() <= 1e-6 * ref.float().abs().max()
    assert (x.grad.float() - x_ref.grad.float()).abs().max() <= tol * x_ref.grad.float().abs().max()
    assert (norm.weight.grad - w_ref.grad).abs().max() <= 1e-5 * w_ref.grad.abs().max()
    norm.weight.requires_grad_(False)  # frozen (LoRA): no weight gradient computed
    earlier = norm.weight.grad.clone()
    x.grad = None
    norm(x).backward(grad)
    assert torch.equal(norm.weight.grad, earlier)  # nothing added to it
    assert (x.grad.float() - x_ref.grad.float()).abs().max() <= tol * x_ref.grad.float().abs().max()


def test_rope_pass_equals_the_rotation_formula_forward_and_backward():
    """RoPE as one C++ pass on CPU (from the projection's token-major layout, as attention calls
    it) against autograd through the formula x cos + rotate_half(x) sin."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 3, 5, 4, 16
    tokens_major = torch.randn(B, T, H, D, generator=gen).requires_grad_()
    angles = torch.randn(
        B, T, D, generator=gen
    )  # halves unlike (a model's repeat): each half's index checked
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(B, H, T, D, generator=gen)
    out = apply_rope(tokens_major.transpose(1, 2), cos, sin)
    out.backward(grad)
    x = tokens_major.detach().clone().requires_grad_()
    xh = x.transpose(1, 2)
    ref = xh * cos[:, None] + torch.cat([-xh[..., D // 2 :], xh[..., : D // 2]], -1) * sin[:, None]
    ref.backward(grad)
    assert (out - ref).abs().max() < 1e-6
    assert (tokens_major.grad - x.grad).abs().max() < 1e-6


def test_kv_cache_decoding_equals_full_forward(arch):
    """Prefill prompts of different lengths into cache slots, decode token by token, compare."""
    model = random_model(arch, seed=5)
    gen = torch.Generator().manual_seed(1)
    lengths, total = [3, 7, 5], 12
    seqs = torch.randint(0, model.config.vocab_size, (3, total), generator=gen)
    with torch.no_grad():
        full = model(seqs).logits  # (3, total, V)
        cache = model.new_cache(slots=3, max_len=total)
        # prefill, right-padded: pad positions continue after the real ones
        T = max(lengths)
        positions = torch.arange(T).expand(3, T)
        pre = model(seqs[:, :T], positions=positions, cache=cache).logits
        for b, n in enumerate(lengths):
            assert (pre[b, :n] - full[b, :n]).abs().max() < 1e-4
        pos = torch.tensor(lengths)
        while int(pos.max()) < total:
            p = pos.clamp(max=total - 1)
            step = model(seqs.gather(1, p[:, None]), positions=p[:, None], cache=cache).logits[:, 0]
            want = full[torch.arange(3), p]
            active = pos < total
            assert (step[active] - want[active]).abs().max() < 1e-4
            pos = pos + 1


def test_kv_cache_slot_reuse_ignores_stale_entries():
    """A slot refilled with a shorter request must not see the previous occupant's keys."""
    model = random_model("qwen3_moe", seed=2)
    a = torch.randint(0, 97, (1, 10))
    b = torch.randint(0, 97, (1, 4))
    cache = model.new_cache(slots=2, max_len=16)
    with torch.no_grad():
        model(a, positions=torch.arange(10)[None], cache=cache, cache_rows=slice(1, 2))
        got = model(b, positions=torch.arange(4)[None], cache=cache, cache_rows=slice(1, 2)).logits
        want = model(b).logits
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("moe_arch", ["qwen3_moe", "qwen2_moe"])
def test_routing_replay(moe_arch):
    model = random_model(moe_arch, seed=7)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    K, L = model.config.num_experts_per_tok, len(model.config.moe_layers)
    assert out.routed_experts.shape == (2, 9, L, K)
    assert len(out.router_logits) == L and out.router_logits[0].shape == (2, 9, model.config.num_experts)

    # Replaying the model's own choice reproduces the logits exactly.
    with torch.no_grad():
        same = model(ids, forced_experts=out.routed_experts)
    assert torch.equal(same.logits, out.logits)
    assert torch.equal(same.routed_experts, out.routed_experts)

    # Forcing other experts changes the logits, and the forced ids are what the model reports.
    E = model.config.num_experts
    other = (out.routed_experts + 1) % E
    changed = model(ids, forced_experts=other)
    assert torch.equal(changed.routed_experts, other)
    assert (changed.logits - out.logits).abs().max() > 1e-3

    # -1 means "router chooses": a half-forced replay matches forcing only the given tokens.
    partial = other.clone()
    partial[:, 5:] = -1
    with torch.no_grad():
        mixed = model(ids, forced_experts=partial)
    assert torch.equal(mixed.routed_experts[:, :5], other[:, :5])

    # Gradients reach the router weights under replay.
    changed.logits.sum().backward()
    for layer in model.config.moe_layers:
        grad = model.model.layers[layer].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_linear_factory_swaps_layers_by_name():
    from miles.models import Transformer, pattern_factory
    from miles.models.linear import default_linear
    from tests.conftest import tiny_config

    made: list[str] = []

    class Tagged(torch.nn.Linear):
        pass

    def tagged(name, i, o, bias):
        made.append(name)
        return Tagged(i, o, bias=bias)

    model = Transformer(
        tiny_config("qwen3_moe"), pattern_factory([("*lm_head", default_linear), ("*experts*", tagged)])
    )
    expert_linears = [n for n, m in model.named_modules() if isinstance(m, Tagged)]
    assert len(expert_linears) == 2 * 4 * 3 and all(".experts." in n for n in expert_linears)
    assert sorted(made) == sorted(expert_linears)  # the factory is told the HF name of each layer
    assert not isinstance(model.lm_head, Tagged)
