"""The engine's lean decode step (miles/rollout/fast_decode.py) against the model's general
forward: same tokens, same log-probs, same routing, for every architecture; weight changes seen;
fallback where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.errors import MilesError
from miles.models import load_model, save_model
from miles.models.routing import RoutingOptions, apply_routing
from miles.rollout import Engine, Request, SamplingParams, fast_decode
from miles.rollout.compiled_decode import GEMV_ROWS, _linear, _own_code, _side_by_side, has_cpp_compiler
from miles.rollout.fast_decode import (
    FastDecoder,
    PackedLinear,
    expert_mlp,
    fuse,
    mkl_packing_works,
    onednn_works,
)
from miles.rollout.sampling import gumbel_noise
from tests.conftest import ARCHS, random_model


@pytest.fixture(autouse=True)
def pack_wherever_mkl_can(monkeypatch):
    """The engine packs only where packing measures faster on this CPU; here the packed path is
    exercised on every CPU with MKL."""
    monkeypatch.setattr(fast_decode, "packing_pays", lambda rows, shape, kind="mkl": True)


def mixed_requests(n: int, seed: int = 0) -> list[Request]:
    """Prompts of different lengths (so rows sit at different positions and masks matter)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 90, (3 + i % 5,), generator=gen).tolist()
        out.append(
            Request(
                prompt, SamplingParams(temperature=0.9, max_new_tokens=6 + i % 4, ignore_eos=True, seed=i)
            )
        )
    return out


def run(model, lean: bool, n: int = 6, slots: int = 6, packed: bool = True):
    engine = Engine(model, max_batch_size=slots, max_seq_len=64, seed=0, lean_decode=lean, packed_gemm=packed)
    return engine, engine.generate(mixed_requests(n))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_step_equals_the_general_forward(arch, packed):
    """Tokens and routing records equal the general forward's, and log-probs too: bit for bit on
    dense models with plain GEMMs (the same kernels on the same rows), within a few fp32 ulps where
    a GEMM's row count differs from the forward's (the experts' padded batches) or MKL's packed
    GEMM runs (bitwise F.linear on some CPUs, one ulp off on others); rows sit at different
    positions."""
    model = random_model(arch, seed=3)
    lean_engine, lean = run(copy.deepcopy(model), lean=True, packed=packed)
    general_engine, general = run(copy.deepcopy(model), lean=False)
    assert lean_engine.decode_path.startswith("lean") and general_engine.decode_path.startswith("general")
    if packed and mkl_packing_works(torch.device("cpu"), torch.float32):
        assert lean_engine._fast.packed_bytes > 0  # the packed path ran for the full batches
    exact = not packed and not model.config.is_moe
    for a, b in zip(lean, general):
        assert a.tokens == b.tokens
        if exact:
            assert a.rollout_log_probs == b.rollout_log_probs
        else:
            gap = max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs))
            assert gap < 4e-6
        if model.config.is_moe:
            assert (a.rollout_routed_experts == b.rollout_routed_experts).all()


@pytest.mark.parametrize("padding_limit", [float("inf"), 0.0], ids=["padded", "per-expert"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_expert_mlp_equals_each_expert_on_its_own_rows(padding_limit, grouped, monkeypatch):
    """Every form of the expert MLP (one padded batch; each expert on its own rows, for a skewed
    load, by torch._grouped_mm or a Python loop) against each row through its experts one by
    one, on routings where experts get no rows, one row, or every row."""
    if grouped and not fast_decode._grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run here")
    monkeypatch.setattr(fast_decode, "PADDING_LIMIT", padding_limit)
    monkeypatch.setattr(fast_decode, "_grouped_mm_works", lambda device, dtype: grouped)
    gen = torch.Generator().manual_seed(0)
    E, hidden, inner, K = 5, 16, 8, 2
    gate_up, down = (
        torch.randn(E, 2 * inner, hidden, generator=gen),
        torch.randn(E, hidden, inner, generator=gen),
    )
    for B in (1, 3, 7):
        x = torch.randn(B, hidden, generator=gen)
        chosen = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B)])
        if B == 7:
            chosen[:, 0] = 4  # one expert takes every row
        weights = torch.rand(B, K, generator=gen)
        want = torch.zeros(B, hidden)
        for b in range(B):
            for k in range(K):
                e = int(chosen[b, k])
                gu = F.linear(x[b : b + 1], gate_up[e])
                want[b] += weights[b, k] * F.linear(F.silu(gu[:, :inner]) * gu[:, inner:], down[e])[0]
        got = expert_mlp(x, chosen, weights, gate_up, down)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)


def test_a_weight_change_reaches_the_lean_step():
    """Through the engine (update_weights) and behind its back (an in-place write into the
    model): the fused tensors are the parameters' storage and the packed copies are redone when a
    parameter's version moves, so the lean step follows either."""
    model = random_model("qwen3_moe", seed=5)
    engine = Engine(model, max_batch_size=4, max_seq_len=64, seed=0)
    greedy = [Request([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=8)) for _ in range(4)]
    before = engine.generate(copy.deepcopy(greedy))
    gen = torch.Generator().manual_seed(1)
    update = [
        (n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()
    ]
    engine.update_weights(update, version=1)
    after_update = engine.generate(copy.deepcopy(greedy))
    reference = copy.deepcopy(model)
    _, want = run(reference, lean=False)
    _, got = run(model, lean=True)  # a second engine on the fused model reuses its fused tensors
    assert [s.tokens for s in got] == [s.tokens for s in want]
    with torch.no_grad():  # behind the engine's back
        for p in model.model.layers[0].self_attn.k_proj.parameters():
            p.mul_(-1.5)
    behind = engine.generate(copy.deepcopy(greedy))
    assert [s.tokens for s in after_update] != [s.tokens for s in before]
    with torch.no_grad():
        for p in reference.model.layers[0].self_attn.k_proj.parameters():
            p.mul_(-1.5)
    oracle = Engine(reference, max_batch_size=4, max_seq_len=64, seed=0, lean_decode=False)
    expected = oracle.generate(copy.deepcopy(greedy))
    assert [s.tokens for s in behind] == [s.tokens for s in expected]
    assert [s.rollout_log_probs for s in behind] == [s.rollout_log_probs for s in expected]


def test_fuse_keeps_each_parameter_and_a_saved_model_loads_back(tmp_path):
    model = random_model("qwen2", seed=2)
    attn = model.model.layers[0].self_attn
    params = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    values = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    fused = fuse(params)
    assert [id(p) for p in params] == ids and all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in params)
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)  # a write into a parameter is a write into the fused tensor
    assert torch.equal(fused[attn.q_proj.out_features :][: attn.k_proj.out_features], values[1] + 1.0)
    again = fuse(params)  # already fused: reused, not copied
    assert again.data_ptr() == fused.data_ptr() and again.shape == fused.shape
    FastDecoder(model)
    save_model(model, tmp_path / "ckpt")  # shared storage is written out as separate tensors
    loaded = load_model(tmp_path / "ckpt")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not mkl_packing_works(torch.device("cpu"), torch.float32), reason="needs MKL")
def test_packed_linear_equals_f_linear_and_repacks_on_change():
    weight = torch.nn.Parameter(torch.randn(96, 64))
    packed = PackedLinear(weight, [weight], rows=8)
    x = torch.randn(8, 64)
    assert torch.allclose(packed(x), torch.nn.functional.linear(x, weight), atol=1e-5)
    assert packed.nbytes > 0
    with torch.no_grad():
        weight.mul_(2)
    assert torch.allclose(packed(x), torch.nn.functional.linear(x, weight), atol=1e-5)
    other = torch.randn(3, 64)  # another row count: plain F.linear
    assert torch.equal(packed(other), torch.nn.functional.linear(other, weight))


needs_onednn = pytest.mark.skipif(
    not onednn_works(torch.device("cpu"), torch.float32), reason="needs a CPU build with oneDNN"
)


def gemm_error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The classic bound on an fp32 dot product's rounding error in any summation order, a bias
    added after: (K + 1) * u * (sum(|x_k| |w_k|) + |b|) per output, u = 2^-24."""
    magnitude = x.abs().double() @ w.abs().double().T
    if b is not None:
        magnitude = magnitude + b.abs().double()
    return (x.shape[-1] + 1) * 2.0**-24 * magnitude


@needs_onednn
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), inner=st.integers(1, 300), out=st.integers(1, 200), seed=st.integers(0, 99))
def test_onednn_packed_linear_is_a_correct_fp32_product(rows, inner, out, seed):
    """oneDNN's product on the packed weight, at any row count (the packing's hint is another),
    against the fp64 product: within the rounding bound every fp32 summation order obeys; the
    bias added."""
    gen = torch.Generator().manual_seed(seed)
    x, w, b = (
        torch.randn(rows, inner, generator=gen),
        torch.randn(out, inner, generator=gen),
        torch.randn(out, generator=gen),
    )
    packed = PackedLinear(w, [w], rows=8, kind="onednn")
    exact = x.double() @ w.double().T
    assert ((packed(x).double() - exact).abs() <= gemm_error_bound(x, w)).all()
    assert ((packed(x, b).double() - (exact + b.double())).abs() <= gemm_error_bound(x, w, b)).all()


@needs_onednn
def test_onednn_packing_follows_the_weights_and_lays_experts_side_by_side():
    """A packed weight is redone when a source parameter's version moves (an in-place update);
    the experts' down projections side by side make the routing-weighted sum over experts one
    product."""
    weight = torch.nn.Parameter(torch.randn(48, 32))
    packed = PackedLinear(weight, [weight], rows=4, kind="onednn")
    x = torch.randn(5, 32)
    first = packed(x)
    with torch.no_grad():
        weight.mul_(-2)
    assert torch.allclose(packed(x), -2 * first, atol=1e-4) and packed.nbytes == weight.numel() * 4
    E, hidden, inner, B = 3, 16, 8, 5
    down, act = torch.randn(E, hidden, inner), torch.randn(B, E, inner)
    want = torch.bmm(act.transpose(0, 1), down.transpose(1, 2)).sum(0)  # each expert, summed
    side = PackedLinear(lambda: _side_by_side(down), [down], rows=B, kind="onednn")
    assert torch.allclose(side(act.reshape(B, E * inner)), want, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_lean_step_on_onednn_keeps_the_tokens_and_log_probs(arch):
    """--rollout-onednn: the lean step's projections on oneDNN, and the prefill's (the general
    forward's F.linear calls rerouted); against the general forward on F.linear: the same tokens
    and experts, log-probs within fp32 rounding (1e-5)."""
    model = random_model(arch, seed=3)
    engine = Engine(copy.deepcopy(model), max_batch_size=6, max_seq_len=64, seed=0, onednn_gemm=True)
    assert "oneDNN" in engine.decode_path and engine._fast.packing == "onednn"
    got = engine.generate(mixed_requests(6))
    _, want = run(model, lean=False)
    assert engine._fast.packed_bytes > 0
    prefill = engine._prefill_mode.table  # every projection, q/k/v apart (the forward's own calls)
    attn = engine.model.model.layers[0].self_attn
    assert len(prefill) >= len(list(fast_decode.projections(engine.model)))
    assert prefill[id(attn.q_proj.weight)].packed is not None  # the prefill ran it
    assert prefill[id(attn.o_proj.weight)] is engine._fast.layers[0].o_proj  # shared with the step
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)) < 1e-5
        if model.config.is_moe:
            assert (a.rollout_routed_experts == b.rollout_routed_experts).all()


def test_onednn_asked_where_it_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fast_decode, "onednn_works", lambda device, dtype: False)
    monkeypatch.setattr("miles.rollout.engine.onednn_works", lambda device, dtype: False)
    with pytest.raises(MilesError, match="--rollout-onednn.*CPU with fp32"):
        Engine(random_model("qwen3", seed=1), max_batch_size=2, max_seq_len=32, onednn_gemm=True)


def test_packing_is_left_off_where_it_measures_slower(monkeypatch):
    monkeypatch.setattr(fast_decode, "packing_pays", lambda rows, shape, kind="mkl": False)
    engine = Engine(random_model("qwen3", seed=1), max_batch_size=4, max_seq_len=32)
    assert engine._fast.packed_rows is None and "measured no faster" in engine.decode_path
    engine.generate(mixed_requests(4))
    assert engine._fast.packed_bytes == 0


def test_lean_step_steps_aside_where_it_cannot_run():
    model = random_model("qwen3_moe", seed=1)
    apply_routing(model, RoutingOptions(capacity_factor=1.0))
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    assert engine.decode_path.startswith("general forward") and "capacity" in engine.decode_path
    with pytest.raises(ValueError, match="capacity"):
        FastDecoder(model)
    deterministic = random_model("llama", seed=1)
    apply_routing(deterministic, RoutingOptions(deterministic=True))
    assert "batch-invariant" in Engine(deterministic, max_batch_size=2, max_seq_len=32).decode_path


def test_gumbel_noise_is_the_per_request_draw():
    """In place and in one buffer, but the same numbers as -log(-log(rand)) per generator."""
    gens = [torch.Generator().manual_seed(s) for s in (3, 1, 4)]
    copies = [torch.Generator().manual_seed(s) for s in (3, 1, 4)]
    got = gumbel_noise(gens, 50)
    want = torch.stack([-torch.log(-torch.log(torch.rand(50, generator=g).clamp(min=1e-20))) for g in copies])
    assert torch.equal(got, want)


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("slots", [4, 6], ids=["few-row products", "oneDNN products"])
def test_compiled_step_agrees_with_the_lean_step_and_survives_a_weight_update(slots):
    """--rollout-compile (4 experts for top-2: the dense expert form; 4 slots: the few-row
    products; 6, with --rollout-onednn where oneDNN runs: every projection on oneDNN's packed
    weights, the experts' down projections side by side): the same greedy tokens and log-probs within fp32 rounding of
    fused kernels, the same experts recorded; a weight update changes the outputs without
    compiling again (weights are graph inputs; packed copies are redone)."""
    import torch._dynamo

    model = random_model("qwen3_moe", seed=4)
    greedy = [Request([5 + i, 6, 7], SamplingParams(temperature=0, max_new_tokens=6)) for i in range(3)]
    lean = Engine(copy.deepcopy(model), max_batch_size=slots, max_seq_len=64, seed=0)
    onednn = slots > GEMV_ROWS and onednn_works(torch.device("cpu"), torch.float32)
    compiled = Engine(
        model, max_batch_size=slots, max_seq_len=64, seed=0, compile_decode=True, onednn_gemm=onednn
    )
    assert compiled.decode_path.startswith("lean, compiled")
    assert {name for _, name in compiled._fast.packed} == (
        {"qkv", "o", "gate_up", "down", "lm_head"} if onednn else set()
    )
    before = compiled_agrees_with_lean(lean, compiled, greedy)
    compiles = len(compiled._fast.steps), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(7)
    update = [
        (n, p.detach() * (1 + 0.3 * torch.randn(p.shape, generator=gen))) for n, p in model.named_parameters()
    ]
    lean.update_weights(update)
    compiled.update_weights(update)
    after = compiled_agrees_with_lean(lean, compiled, greedy)
    assert [s.tokens for s in after] != [s.tokens for s in before]
    assert (len(compiled._fast.steps), torch._dynamo.utils.counters["stats"]["unique_graphs"]) == compiles
    shared = random_model("qwen2_moe", seed=4)
    assert "not compiled" in Engine(shared, max_batch_size=2, max_seq_len=32, compile_decode=True).decode_path


def compiled_agrees_with_lean(lean: Engine, compiled: Engine, requests: list[Request]) -> list:
    """The compiled engine's samples of `requests`, checked against the lean engine's: the same
    greedy tokens and experts, log-probs within fp32 rounding of fused kernels (1e-4)."""
    want, got = lean.generate(copy.deepcopy(requests)), compiled.generate(copy.deepcopy(requests))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    gap = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.rollout_log_probs, y.rollout_log_probs))
    assert gap < 1e-4
    assert all((x.rollout_routed_experts == y.rollout_routed_experts).all() for x, y in zip(got, want))
    return got


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")
def test_compiled_step_keeps_many_experts_sparse(monkeypatch):
    """16 experts for top-2 (past DENSE_EXPERTS): the experts run through the opaque custom op
    miles::expert_mlp inside the graph (called on all 6 slots, in every layer of every step), and
    agree with the lean step; 6 slots: plain GEMMs."""
    import miles.rollout.compiled_decode as compiled_decode

    rows = []

    def counted(x, *args):
        rows.append(x.shape[0])
        return expert_mlp(x, *args)

    monkeypatch.setattr(compiled_decode, "expert_mlp", counted)  # what the custom op calls
    model = random_model("qwen3_moe", seed=5, num_experts=16)
    greedy = [Request([9 + i, 4, 7, 3], SamplingParams(temperature=0, max_new_tokens=5)) for i in range(5)]
    lean = Engine(copy.deepcopy(model), max_batch_size=6, max_seq_len=64, seed=0)
    compiled = Engine(model, max_batch_size=6, max_seq_len=64, seed=0, compile_decode=True)
    assert compiled.decode_path.startswith("lean, compiled")
    compiled_agrees_with_lean(lean, compiled, greedy)
    steps = compiled.times.decode_steps
    assert steps == 4 and set(rows) == {6} and len(rows) >= steps * model.config.num_hidden_layers


def test_the_compiled_steps_few_row_product_is_f_linear():
    """At up to GEMV_ROWS rows the compiled step writes each projection as a multiply and a sum
    (inductor reads the weight once); the same product as F.linear, bias included."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    for rows in range(1, GEMV_ROWS + 1):
        x = torch.randn(rows, 40, generator=gen)
        assert _linear(rows) is not F.linear
        assert torch.allclose(_linear(rows)(x, w, b), F.linear(x, w, b), atol=1e-5)
        assert torch.allclose(_linear(rows)(x, w), F.linear(x, w), atol=1e-5)
    assert _linear(GEMV_ROWS + 1) is F.linear


def test_each_compiled_step_has_its_own_dynamo_cache():
    """Step functions share one code object; dynamo caches graphs per code object and, past its
    recompile limit (8), silently runs the function eager. Each step gets a code object of its
    own, so a twelfth bucket (or engine) still compiles."""
    import torch._dynamo

    def make(n: int):
        def step(x):
            return x * n + 1

        return step

    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    x = torch.ones(3)
    for n in range(12):
        assert torch.equal(torch.compile(_own_code(make(n)), backend="eager")(x), x * n + 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 12
