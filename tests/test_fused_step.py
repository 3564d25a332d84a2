"""The decode steps (miles/rollout/steps): the fused C++ step against the model's general
forward (its GEMM and exponential against exact arithmetic, one step's logits, cache writes and
experts for every architecture, an engine's tokens and log-probs, a weight update), and which
step `auto` chooses where, with its reason."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.errors import MilesError
from miles.models.routing import RoutingOptions, apply_routing
from miles.quant.convert import to_int4
from miles.quant.int4_linear import Int4Linear
from miles.rollout import Engine, Request, SamplingParams
from miles.rollout.steps import fused as fused_step
from miles.rollout.steps.fused import FusedStep, fused_unsupported, library, pack_panels
from tests.conftest import ARCHS, random_model

pytestmark = pytest.mark.skipif(fused_step.compiler() is None, reason="needs a C++ compiler")


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    """One build per test session, outside the user's cache."""
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))


def gemm_error_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Any fp32 summation order of a dot product of length K is within (K + 1) u sum|a||b|."""
    return (a.shape[1] + 1) * 2.0**-24 * (a.abs().double() @ b.abs().double())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.one_of(st.integers(1, 11), st.integers(120, 300)),
    inner=st.integers(1, 150),
    out=st.integers(1, 200),
    seed=st.integers(0, 99),
)
def test_the_steps_gemm_is_a_correct_fp32_product(rows, inner, out, seed):
    """Every row and column remainder of the register-blocked kernel (rows in 4s and in chunks of
    128, outputs in panels of 64, a last panel's in 16s then one by one, the panel's rows in runs)
    on the weight packed in panels, against the fp64 product, within the rounding bound; the bias
    added; each row's bits the same as that row's product alone."""
    gen = torch.Generator().manual_seed(seed)
    a, b, bias = (
        torch.randn(rows, inner, generator=gen),
        torch.randn(inner, out, generator=gen),
        torch.randn(out),
    )
    got, with_bias, packed = torch.empty(rows, out), torch.empty(rows, out), pack_panels(b)
    lib = library()
    lib.miles_fused_gemm(rows, inner, out, a.data_ptr(), packed.data_ptr(), None, got.data_ptr())
    lib.miles_fused_gemm(
        rows, inner, out, a.data_ptr(), packed.data_ptr(), bias.data_ptr(), with_bias.data_ptr()
    )
    alone = torch.empty(rows, out)  # each row by itself: one row block, no runs of KC rows of the panel
    for i in range(rows):
        lib.miles_fused_gemm(1, inner, out, a[i].data_ptr(), packed.data_ptr(), None, alone[i].data_ptr())
    assert torch.equal(got, alone)
    exact = a.double() @ b.double()
    bound = gemm_error_bound(a, b)
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((with_bias.double() - exact - bias.double()).abs() <= bound + 2**-23 * (exact + bias).abs()).all()


def test_the_steps_exponential_is_accurate_to_a_few_ulps():
    """The softmax's and SiLU's e^x, over the whole range they meet, against float64."""
    x = torch.cat([torch.linspace(-87, 88, 200_001), torch.tensor([0.0, -1e-8, 1e-8, -0.5, 0.5])])
    y = torch.empty_like(x)
    library().miles_fused_exp(x.numel(), x.data_ptr(), y.data_ptr())
    exact = np.exp(x.double().numpy())
    relative = np.abs(y.double().numpy() - exact) / exact
    assert relative.max() < 4 * 2.0**-24


def filled_cache(model, slots: int, max_len: int, seed: int):
    cache = model.new_cache(slots, max_len)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


SPLITS = {"rows": 0, "columns": 10**6}  # wide_below: threads take rows / share every product


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("arch", ARCHS)
def test_one_step_equals_the_general_forward(arch, split):
    """Rows at different positions of a filled cache (so each sees its own prefix), the threads
    splitting the rows or each product's columns: logits within fp32 rounding of the general
    forward's, the same experts, and the same keys and values written where the forward writes
    them (and nothing else)."""
    model = random_model(arch, seed=3)
    slots, max_len = 7, 24
    ids = torch.randint(0, model.config.vocab_size, (slots,), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 5, 23, 11, 2, 17, 9])
    want_cache, got_cache = filled_cache(model, slots, max_len, 0), filled_cache(model, slots, max_len, 0)
    with torch.no_grad():
        want = model(ids[:, None], positions=positions[:, None], cache=want_cache, cache_rows=slice(0, slots))
    got = FusedStep(model, threads=2, wide_below=SPLITS[split]).decode(
        ids[:, None], positions[:, None], got_cache
    )
    assert got.logits.shape == want.logits.shape
    assert torch.allclose(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    assert got.hidden.shape == want.hidden.shape  # the final-normed state an EAGLE draft reads
    assert torch.allclose(got.hidden, want.hidden, atol=2e-5, rtol=1e-5)
    for a, b in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        assert torch.allclose(a, b, atol=1e-5)
    if model.config.is_moe:
        assert torch.equal(got.routed_experts, want.routed_experts)
    else:
        assert got.routed_experts is None


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "llama"])
def test_a_verification_of_several_tokens_a_row_equals_the_general_forward(arch, split):
    """Speculative verification: rows of k + 1 tokens from their own positions of a filled
    cache, each causal within its row: every token's logits within fp32 rounding of the
    general forward's, the same keys and values written, the same experts."""
    model = random_model(arch, seed=4)
    slots, max_len, width = 5, 24, 4
    ids = torch.randint(
        0, model.config.vocab_size, (slots, width), generator=torch.Generator().manual_seed(2)
    )
    positions = torch.tensor([0, 7, 20, 3, 12])[:, None] + torch.arange(width)
    want_cache, got_cache = filled_cache(model, slots, max_len, 0), filled_cache(model, slots, max_len, 0)
    with torch.no_grad():
        want = model(ids, positions=positions, cache=want_cache, cache_rows=slice(0, slots))
    got = FusedStep(model, threads=2, wide_below=SPLITS[split]).decode(ids, positions, got_cache)
    assert got.logits.shape == want.logits.shape == (slots, width, model.config.vocab_size)
    assert torch.allclose(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    assert torch.allclose(got.hidden, want.hidden, atol=2e-5, rtol=1e-5)  # every token's
    for a, b in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        assert torch.allclose(a, b, atol=1e-5)
    if model.config.is_moe:
        assert torch.equal(got.routed_experts, want.routed_experts)


@pytest.mark.parametrize("width", [1, 3])
def test_a_step_over_some_slots_equals_those_rows_of_a_full_step(width):
    """The tail of a rollout: rows left in slots 1 and 4 of 5. Both steps, given those slots, give
    those rows' logits, hidden states and cache writes as a step over every slot does; the fused
    step leaves the other slots' cache as it was (it reads and writes only the rows it runs)."""
    from miles.rollout.steps.general import GeneralStep

    model = random_model("qwen3_moe", seed=5)
    slots, max_len = 5, 24
    ids = torch.randint(
        0, model.config.vocab_size, (slots, width), generator=torch.Generator().manual_seed(3)
    )
    positions = torch.tensor([4, 9, 2, 15, 6])[:, None] + torch.arange(width)
    full_cache = filled_cache(model, slots, max_len, 0)
    with torch.no_grad():
        full = model(ids, positions=positions, cache=full_cache, cache_rows=slice(0, slots))
    busy = torch.tensor([1, 4])
    untouched = filled_cache(model, slots, max_len, 0)
    for step in (FusedStep(model, threads=2), GeneralStep(model)):
        cache = filled_cache(model, slots, max_len, 0)
        got = step.decode(ids[busy], positions[busy], cache, busy)
        assert torch.allclose(got.logits, full.logits[busy], atol=2e-5, rtol=1e-5)
        assert torch.allclose(got.hidden, full.hidden[busy], atol=2e-5, rtol=1e-5)
        assert torch.equal(got.routed_experts, full.routed_experts[busy])
        for a, b in zip(cache.keys + cache.values, full_cache.keys + full_cache.values):
            assert torch.allclose(a[busy], b[busy], atol=1e-5)
        if step.name == "fused":
            for a, b in zip(cache.keys + cache.values, untouched.keys + untouched.values):
                assert torch.equal(a[[0, 2, 3]], b[[0, 2, 3]])


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "llama"])
def test_a_prefill_equals_the_general_forwards(arch, split):
    """Right-padded prompts of different lengths into scattered cache slots, several tokens per
    sequence (each attending causally to its own prefix): the last token's logits, the keys and
    values of every real position, and the experts of every real token."""
    model = random_model(arch, seed=2)
    slots, max_len, T = 6, 16, 9
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 1, 4, 7])
    ids = torch.randint(0, model.config.vocab_size, (4, T), generator=gen)
    rows = torch.tensor([5, 0, 3, 2])
    real = torch.arange(T)[None, :] < lengths[:, None]
    want_cache, got_cache = filled_cache(model, slots, max_len, 1), filled_cache(model, slots, max_len, 1)
    with torch.no_grad():
        want = model(
            ids, positions=torch.arange(T).expand(4, T), cache=want_cache, cache_rows=rows,
            logits_at=lengths - 1, token_mask=real,
        )  # fmt: skip
    got = FusedStep(model, threads=2, wide_below=SPLITS[split]).prefill(ids, lengths, rows, got_cache)
    assert torch.allclose(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    assert got.hidden.shape == want.hidden.shape == (4, 1, model.config.hidden_size)  # the last token's
    assert torch.allclose(got.hidden, want.hidden, atol=2e-5, rtol=1e-5)
    for a, b in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        for slot, n in zip(rows, lengths):
            assert torch.allclose(a[slot, :, :n], b[slot, :, :n], atol=1e-5)
        untouched = [s for s in range(slots) if s not in rows.tolist()]
        assert torch.equal(a[untouched], b[untouched])
    if model.config.is_moe:
        assert torch.equal(got.routed_experts[real], want.routed_experts[real])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(arch):
    """Each row's arithmetic is its own (the same products in the same order whichever rows share
    the step or its 4-row blocks, and whether the threads split the rows or share every product's
    columns): a row decoded with six others, alone, or on one thread gives the same bits."""
    model = random_model(arch, seed=6)
    slots, max_len = 7, 24
    ids = torch.randint(0, model.config.vocab_size, (slots,), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([3, 9, 0, 17, 5, 12, 20])
    batch = FusedStep(model, threads=2, wide_below=0).decode(
        ids[:, None], positions[:, None], filled_cache(model, slots, max_len, 4)
    )
    for threads, wide_below in ((1, 0), (2, 10**6), (8, 10**6)):  # one thread; a team sharing each product
        other = FusedStep(model, threads=threads, wide_below=wide_below)
        got = other.decode(ids[:, None], positions[:, None], filled_cache(model, slots, max_len, 4))
        assert torch.equal(got.logits, batch.logits)
    alone_cache = filled_cache(model, slots, max_len, 4)
    for row in (0, 3, 6):  # row b alone, in cache slot b
        one = FusedStep(model).forward(
            ids[row : row + 1],
            positions[row : row + 1],
            torch.tensor([0, 1]),
            torch.tensor([row]),
            alone_cache,
        )[0]
        assert torch.equal(one[0], batch.logits[row, 0])


def requests(n: int) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    return [
        Request(
            torch.randint(3, 90, (3 + i % 5,), generator=gen).tolist(),
            SamplingParams(temperature=0.9, max_new_tokens=6 + i % 4, ignore_eos=True, seed=i),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_an_engine_on_the_fused_step_keeps_tokens_log_probs_and_experts(arch):
    """The default step on CPU through the engine (refills, free slots, rows ending at different
    lengths, two threads): the tokens and experts of the general forward, log-probs within fp32
    rounding."""
    model = random_model(arch, seed=3)
    fused = Engine(copy.deepcopy(model), max_batch_size=6, max_seq_len=64, seed=0)
    general = Engine(model, max_batch_size=6, max_seq_len=64, seed=0, decode_step="general")
    assert fused.decode_step.name == "fused" and fused.decode_path.startswith("fused")
    assert general.decode_step.name == "general"
    got, want = fused.generate(requests(9)), general.generate(requests(9))
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)) < 1e-5
        if model.config.is_moe:
            assert (a.rollout_routed_experts == b.rollout_routed_experts).all()


def test_a_weight_update_reaches_the_fused_step():
    """The packed copies are remade (in their buffers) when a parameter's version moves, whether
    the engine's update wrote it or something wrote it behind the engine's back: the fused
    engine's greedy tokens are then those of a general-forward engine given the same change."""
    model = random_model("qwen3_moe", seed=5)
    fused = Engine(copy.deepcopy(model), max_batch_size=4, max_seq_len=64, seed=0)
    general = Engine(model, max_batch_size=4, max_seq_len=64, seed=0, decode_step="general")
    greedy = [Request([5 + i, 6, 7], SamplingParams(temperature=0, max_new_tokens=8)) for i in range(4)]
    before = fused.generate(copy.deepcopy(greedy))
    packed = [t.data_ptr() for t in fused.decode_step._buffers.values()]
    gen = torch.Generator().manual_seed(1)
    update = [
        (n, p.detach() * (1 + 0.3 * torch.randn(p.shape, generator=gen))) for n, p in model.named_parameters()
    ]
    fused.update_weights(update, version=1)
    general.update_weights(update, version=1)
    after, want = fused.generate(copy.deepcopy(greedy)), general.generate(copy.deepcopy(greedy))
    assert [s.tokens for s in after] != [s.tokens for s in before]
    assert [s.tokens for s in after] == [s.tokens for s in want]
    assert [t.data_ptr() for t in fused.decode_step._buffers.values()] == packed  # rewritten in place
    with torch.no_grad():  # behind the engines' backs
        for engine in (fused, general):
            for p in engine.model.model.layers[0].self_attn.k_proj.parameters():
                p.mul_(-1.5)
    behind, want = fused.generate(copy.deepcopy(greedy)), general.generate(copy.deepcopy(greedy))
    assert [s.tokens for s in behind] != [s.tokens for s in after]
    assert [s.tokens for s in behind] == [s.tokens for s in want]


def test_auto_steps_aside_with_a_reason_and_fused_asked_for_is_refused(monkeypatch):
    """Where the fused step cannot run, `auto` takes the general forward and says why; asking for
    `fused` there is an error naming the flag and the reason."""
    capacity = random_model("qwen3_moe", seed=1)
    apply_routing(capacity, RoutingOptions(capacity_factor=1.0))
    deterministic = random_model("llama", seed=1)
    apply_routing(deterministic, RoutingOptions(deterministic=True))
    for model, why in ((capacity, "capacity"), (deterministic, "batch-invariant")):
        engine = Engine(model, max_batch_size=2, max_seq_len=32)
        assert engine.decode_step.name == "general" and why in engine.decode_path
        with pytest.raises(MilesError, match=f"--rollout-decode-step fused cannot run.*{why}"):
            Engine(model, max_batch_size=2, max_seq_len=32, decode_step="fused")
    model = random_model("qwen3", seed=1)
    monkeypatch.setattr(fused_step, "compiler", lambda: None)
    assert "C++ compiler" in fused_unsupported(model)
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    assert engine.decode_step.name == "general" and "no C++ compiler" in engine.decode_path
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        FusedStep(model)


def test_a_build_that_fails_leaves_the_general_forward_and_says_why(monkeypatch, tmp_path):
    """A cache directory that cannot be written (or a compiler that fails): the engine takes the
    general forward, and its decode path names the failure."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(blocked / "kernels"))  # under a file: mkdir fails
    monkeypatch.setattr(fused_step, "library", fused_step.library.__wrapped__)  # no cached build
    engine = Engine(random_model("qwen3", seed=1), max_batch_size=2, max_seq_len=32)
    assert engine.decode_step.name == "general" and "its build failed" in engine.decode_path


def test_a_token_id_outside_the_vocabulary_is_a_clear_error():
    """The C++ step reads the embedding row a token names unchecked, so the engine and the step
    refuse an id outside the vocabulary first, naming the range."""
    model = random_model("qwen3", seed=1)
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    with pytest.raises(MilesError, match=r"\[0, 97\).*\[97\]"):
        engine.add_request(Request([5, 97], SamplingParams(max_new_tokens=2)))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        FusedStep(model).decode(torch.tensor([[3], [-1]]), torch.tensor([[0], [0]]), model.new_cache(2, 8))


def int4_pair(arch: str, group: int, seed: int):
    """(a model whose projections are INT4 engine layers, the same model in plain fp32 with each
    projection's weight on the INT4 grid: what the INT4 layers multiply by)."""
    model = random_model(arch, seed=seed)
    grid = copy.deepcopy(model)
    to_int4(model, group, store_packed=True)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Int4Linear):
                grid.get_submodule(name).weight.copy_(module.dequantized_weight())
    return model, grid


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "qwen2_moe"])
def test_an_int4_step_is_the_fp32_step_on_its_grid_weights_bit_for_bit(arch, split):
    """The INT4 engine's packed codes go into the fused step as codes (a quarter of the bytes of
    an fp32 weight, dequantized in L1 run by run): a step and a prefill give the fp32 step's bits
    on the dequantized weights (the same products summed in the same order), its cache writes
    and its experts; and within fp32 rounding of the INT4 model's general forward. Group 16
    against runs of 64 rows, 7 rows (a 4-row block and a remainder), panels of 64 and not."""
    model, grid = int4_pair(arch, group=16, seed=7)
    assert fused_unsupported(model) is None
    slots, max_len = 7, 24
    ids = torch.randint(0, model.config.vocab_size, (slots,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 5, 23, 11, 2, 17, 9])
    caches = [filled_cache(model, slots, max_len, 0) for _ in range(3)]
    int4, fp32 = (
        FusedStep(m, threads=2, wide_below=SPLITS[split]).decode(ids[:, None], positions[:, None], c)
        for m, c in ((model, caches[0]), (grid, caches[1]))
    )
    assert torch.equal(int4.logits, fp32.logits)
    assert all(
        torch.equal(a, b)
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values)
    )
    if model.config.is_moe:
        assert torch.equal(int4.routed_experts, fp32.routed_experts)
    with torch.no_grad():
        want = model(ids[:, None], positions=positions[:, None], cache=caches[2], cache_rows=slice(0, slots))
    assert torch.allclose(int4.logits, want.logits, atol=2e-5, rtol=1e-5)
    prompts, lengths = (
        torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(4)),
        torch.tensor([9, 4, 6]),
    )
    a, b = (
        FusedStep(m, threads=2, wide_below=SPLITS[split]).prefill(
            prompts, lengths, torch.arange(3), m.new_cache(3, 16)
        )
        for m in (model, grid)
    )
    assert torch.equal(a.logits, b.logits)


def test_int4_engines_choose_the_fused_step_unless_bf16_activations_are_asked_for():
    """An INT4 engine (fp32 activations) decodes on the fused step with the general forward's
    tokens; one asked for bf16 activations keeps torch's INT4 kernel and says why."""
    model, _ = int4_pair("qwen3", group=16, seed=2)
    fused = Engine(copy.deepcopy(model), max_batch_size=4, max_seq_len=48, seed=0)
    general = Engine(model, max_batch_size=4, max_seq_len=48, seed=0, decode_step="general")
    assert fused.decode_step.name == "fused"
    got, want = fused.generate(requests(5)), general.generate(requests(5))
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)) < 1e-5
    bf16 = random_model("qwen3", seed=2)
    to_int4(bf16, 32, store_packed=True, activations="bf16")  # a group size torch's kernel takes
    if any(m.kernel for m in bf16.modules() if isinstance(m, Int4Linear)):  # a torch build with the kernel
        engine = Engine(bf16, max_batch_size=2, max_seq_len=32)
        assert engine.decode_step.name == "general" and "bf16 activations" in engine.decode_path


def test_experts_filling_whole_panels_pack_in_one_copy_a_projection_as_part_by_part(monkeypatch):
    """Experts whose projections fill whole panels are packed all at once a projection; the
    buffers are bitwise those of packing each expert's parts one by one, and the step's logits
    equal the general forward's."""
    model = random_model("qwen3_moe", seed=2, moe_intermediate_size=128)
    at_once = FusedStep(model)
    at_once._pack()
    assert any(at_once._experts_at_once.values())
    monkeypatch.setattr(fused_step, "_stackable", lambda parts: False)
    one_by_one = FusedStep(model)
    one_by_one._pack()
    assert not any(one_by_one._experts_at_once.values())
    assert at_once._buffers.keys() == one_by_one._buffers.keys()
    for key, packed in at_once._buffers.items():
        assert torch.equal(packed, one_by_one._buffers[key]), key
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(3, 16)
    out = at_once.prefill(ids, torch.full((3,), 7), torch.arange(3), cache)
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
    assert (out.logits[:, 0] - ref).abs().max() < 1e-4
