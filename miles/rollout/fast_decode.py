"""A lean one-token decode step for the rollout engine: the same arithmetic as the model's
forward, in fewer and larger kernels.

The model's general forward serves training, prefill and every option (FP8, INT4, batch
invariance, expert capacity, expert parallelism, offload). A decode step needs none of that, and
at the sizes RL rollout runs on a CPU its cost is the number of operators, not the bytes
(docs/performance.md, "Where a decode step goes"). Here:

- q/k/v and gate/up run as one GEMM each, and each MoE layer's experts as one batched GEMM per
  projection over expert-sorted rows (`expert_mlp`: one gather, one scatter). Their weights are laid out once
  into one tensor per group, and the model's parameters become views of it: a weight update (an
  in-place copy into the parameters) lands in the fused tensor, nothing is copied per step, and
  no memory is added;
- RMSNorm runs in five kernels instead of the module's eight, q_norm and k_norm in one pass,
  RoPE on q and k together, and the step runs under `torch.inference_mode`;
- on a CPU with MKL, the projections of a full batch (as many rows as the engine has slots) use
  weights packed once into MKL's GEMM layout (`PackedLinear`): unpacked, MKL packs the weight
  again on every call, which is most of a small-batch GEMM. That pays on some CPUs and not on
  others, so it is measured once (`packing_pays`). Packed results are `F.linear`'s bits or one
  ulp off, by CPU; the packed copies cost about three times the packed weights' memory.

The engine uses it when `unsupported(model)` is None and falls back to the general forward
otherwise (FP8/INT4 layers, batch-invariant routing, expert capacity, sharded or offloaded
experts). Its logits equal the general forward's bitwise on dense models with plain GEMMs, and
within a few fp32 ulps where a GEMM runs on another number of rows (the experts' batches) or on
packed weights (tests/test_fast_decode.py); the measurements are in docs/performance.md.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput, MoE, Transformer, rope_cos_sin


def unsupported(model: Transformer) -> str | None:
    """Why the lean step cannot run this model (None: it can)."""
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'the model'} has forward hooks (tensor parallelism, instrumentation)"
        if getattr(module, "batch_invariant", False):
            return f"{name} is batch-invariant (--deterministic-expert-routing)"
        if isinstance(module, MoE):
            if module.routing.capacity_factor is not None or module.routing.deterministic:
                return f"{name} routes with capacity or deterministic ties"
            if module.expert_parallel is not None or module.expert_loader is not None:
                return f"{name} has sharded or offloaded experts"
            if not isinstance(module.experts, nn.ModuleList):
                return f"{name} keeps its experts in a {type(module.experts).__name__}"
    layers = list(projections(model))
    odd = [type(m).__name__ for m in layers if type(m) is not nn.Linear]
    if odd:
        return f"projections of type {odd[0]} (FP8, INT4 or sharded layers)"
    if len({(m.weight.dtype, m.weight.device) for m in layers}) > 1:
        return "projections on several devices or dtypes"
    return None


def projections(model: Transformer):
    """Every projection module the lean step reads the weight of."""
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        yield from (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
        if isinstance(mlp, MoE):
            yield mlp.gate
            for e in mlp.experts:
                yield from (e.gate_proj, e.up_proj, e.down_proj)
        else:
            yield from (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    yield model.lm_head


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in the module's own order, weight * (x * rsqrt(mean(x^2) + eps)): bitwise its
    result in fewer kernels (`F.rms_norm` on CPU runs about eight)."""
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * scale).mul_(weight)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and rotate-half-signed sin (B, 1, D) for one position per row: `rotate(x)` is then
    x.roll(D/2) * signed_sin, with the same bits as the model's cat([-x2, x1]) * sin."""
    cos, sin = rope_cos_sin(positions[:, None], inv_freq)
    half = cos.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, D) rotated; q and k heads together."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin))


def cache_rows(positions: torch.Tensor, kv_heads: int, max_len: int) -> torch.Tensor:
    """The rows of a layer's (slots*KV*L, D) cache view that rows 0..B-1 write at `positions`:
    row b, head j, position p of (slots, KV, L, D) is row (b*KV + j)*L + p."""
    B = positions.shape[0]
    slots = torch.arange(B, device=positions.device)[:, None] * kv_heads
    heads = torch.arange(kv_heads, device=positions.device)
    return ((slots + heads) * max_len + positions[:, None]).reshape(-1)


def fuse(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor holding `params` concatenated along dim 0; each parameter becomes a view of its
    part (its identity, and so any optimizer's reference to it, stays). Already fused params (a
    second engine on the same model) are reused as they lie."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    storage = first.untyped_storage()
    offset, consecutive = first.storage_offset(), True
    for p in params:
        consecutive &= (
            p.is_contiguous() and p.untyped_storage().data_ptr() == storage.data_ptr()
        ) and p.storage_offset() == offset
        offset += p.numel()
    if consecutive:
        return first.detach().new_empty(0).set_(storage, first.storage_offset(), shape)
    fused = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


@functools.cache
def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here on this dtype and matches per-group GEMMs."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x, w = torch.randn(5, 8, device=device, dtype=dtype), torch.randn(3, 8, 4, device=device, dtype=dtype)
        offs = torch.tensor([2, 2, 5], device=device, dtype=torch.int32)
        got = torch._grouped_mm(x, w, offs=offs)
        want = torch.cat([x[:2] @ w[0], x[2:] @ w[2]])
        return bool(torch.allclose(got, want, atol=1e-4))
    except (RuntimeError, NotImplementedError):
        return False


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen experts), each (B, K): the top-k of the router's softmax in fp32,
    renormalized to sum to 1 when the model says so (the general forward's routing without
    capacity, replay or ties broken by index)."""
    weights, chosen = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, chosen


PADDING_LIMIT = 2.0  # the padded batch may hold at most this many rows per routed row


def expert_mlp(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The experts' SwiGLU MLPs on the rows of x that chose them, summed with the routing
    weights: x (B, hidden), chosen and weights (B, K), gate_up (E, 2I, hidden), down (E, hidden, I)
    -> (B, hidden).

    Rows are sorted by expert. When the load is even enough (the padded batch at most
    PADDING_LIMIT times the routed rows) they are laid out in an (E, C, hidden) batch, C the
    busiest expert's count (the rest of each expert's C rows repeat row 0 and are never read
    back), so each projection is one `bmm` and no Python loop runs over experts: at decode sizes
    with an even load, about 1.5x faster than CPU `torch._grouped_mm` (a C++ loop of per-group
    GEMMs). A skewed load would multiply the padded work, so then each expert runs on its own
    rows: `torch._grouped_mm` where it runs, else a Python loop.
    """
    B, K = chosen.shape
    E, inner = down.shape[0], down.shape[-1]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // K
    counts = torch.bincount(flat, minlength=E)
    capacity = int(counts.max())
    if E * capacity <= PADDING_LIMIT * B * K:
        expert = flat.index_select(0, order)  # each sorted row's expert
        start = counts.cumsum(0).sub_(counts)
        place = (
            torch.arange(B * K, device=x.device).sub_(start.index_select(0, expert)).add_(expert * capacity)
        )
        source = torch.zeros(E * capacity, dtype=torch.long, device=x.device).index_copy_(0, place, token)
        batch = x.index_select(0, source).view(E, capacity, -1)
        gu = torch.bmm(batch, gate_up.transpose(1, 2))
        act = F.silu(gu[..., :inner]).mul_(gu[..., inner:])
        y = torch.bmm(act, down.transpose(1, 2)).view(E * capacity, -1).index_select(0, place)
    elif _grouped_mm_works(x.device, x.dtype):
        rows, offs = x.index_select(0, token), counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(gu[:, :inner]).mul_(gu[:, inner:]), down.transpose(1, 2), offs=offs)
    else:
        outs = []
        for e, rows in enumerate(x.index_select(0, token).split(counts.tolist())):
            if rows.shape[0]:
                gu = F.linear(rows, gate_up[e])
                outs.append(F.linear(F.silu(gu[:, :inner]).mul_(gu[:, inner:]), down[e]))
        y = torch.cat(outs)
    y = y.mul_(weights.to(x.dtype).reshape(-1).index_select(0, order)[:, None])
    return torch.zeros_like(x).index_add_(0, token, y)  # in the forward's order of summation


def mkl_packing_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether MKL's packed GEMM runs here (a CPU build with MKL, fp32) and agrees with F.linear."""
    return _packing_works("mkl", device, dtype)


def onednn_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear on a packed weight runs here (a CPU build with oneDNN, fp32) and
    agrees with F.linear to fp32 rounding."""
    return _packing_works("onednn", device, dtype)


def require_onednn(weight: torch.Tensor) -> None:
    """Raise unless oneDNN's packed linear can run on `weight`'s device and dtype."""
    if not onednn_works(weight.device, weight.dtype):
        raise ValueError(
            f"oneDNN's packed linear does not run here ({weight.device}, {weight.dtype}): it needs a CPU "
            "build with oneDNN and fp32 weights"
        )


@functools.cache
def _packing_works(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    library = {"mkl": torch.backends.mkl, "onednn": torch.backends.mkldnn}[kind]
    if device.type != "cpu" or dtype != torch.float32 or not library.is_available():
        return False
    try:
        w, x = torch.randn(64, 32), torch.randn(3, 32)
        packed, _ = _PACKERS[kind](w, 3)
        return bool(torch.allclose(packed(x), F.linear(x, w), atol=1e-5 if kind == "mkl" else 1e-4))
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def packing_pays(rows: int, shape: tuple[int, int], kind: str = "mkl", trials: int = 7) -> bool:
    """Whether a packed GEMM (`kind`: "mkl" or "onednn") beats F.linear at `rows` rows on a
    weight of `shape` on this CPU (median of `trials` interleaved timings, at least 10% faster).
    It does on some CPUs and is slower on others (docs/performance.md), so it is measured once."""
    w, x = torch.randn(shape), torch.randn(rows, shape[1])
    packed, _ = _PACKERS[kind](w, rows)
    calls = 3

    def timed(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    plain, fast = [], []
    with torch.inference_mode():
        for _ in range(trials):
            plain.append(timed(lambda: F.linear(x, w)))
            fast.append(timed(lambda: packed(x)))
    return statistics.median(fast) < 0.9 * statistics.median(plain)


class PackedLinear:
    """F.linear(x, weight) on a weight packed once for a GEMM library: MKL's packed GEMM when x
    has exactly `rows` rows (else F.linear; both give the same bits, or one ulp apart by CPU), or
    with `kind="onednn"` oneDNN's linear at any row count (its own blocking: fp32 rounding differs
    from F.linear's, by about as much as two GEMM libraries differ from each other).

    `weight` may be a function giving the (out, in) weight, for a layout the model does not keep
    (the experts' down projections side by side); it is called at each packing. The weight is
    packed on first use and again whenever one of its source parameters changed (their version
    counters move with every in-place write, so a weight update is seen without being announced)."""

    def __init__(
        self, weight: torch.Tensor | Callable[[], torch.Tensor], sources: list[torch.Tensor], rows: int,
        kind: str = "mkl",
    ) -> None:  # fmt: skip
        self.weight_of = weight if callable(weight) else (lambda: weight)
        self.weight = None if callable(weight) else weight  # the tensor F.linear would be given
        self.sources, self.rows, self.kind = sources, rows, kind
        self.packed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        self.versions: list[int] = []
        self.nbytes = 0  # memory of the packed copy

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "mkl" and x.shape[0] != self.rows:
            return F.linear(x, self.weight_of(), bias)
        versions = [p._version for p in self.sources]
        if self.packed is None or versions != self.versions:
            self.packed, self.nbytes = _PACKERS[self.kind](self.weight_of().detach(), self.rows)
            self.versions = versions
        return self.packed(x, bias)


def pack_mkl(weight: torch.Tensor, rows: int) -> tuple[Callable, int]:
    """MKL's packed GEMM for `rows` rows, and the packed copy's bytes."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    call = lambda x, bias=None: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)  # noqa: E731
    return call, packed.numel() * packed.element_size()


def pack_onednn(weight: torch.Tensor, rows: int) -> tuple[Callable, int]:
    """oneDNN's linear on the weight reordered into its blocked layout (any row count; `rows` is
    a hint), and the reordered copy's bytes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)
    call = lambda x, bias=None: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: E731
    return call, weight.numel() * weight.element_size()


_PACKERS = {"mkl": pack_mkl, "onednn": pack_onednn}


class PackedPrefill(TorchFunctionMode):
    """While active, `F.linear` on a weight of `table` (by identity) runs that weight's packed
    product: the engine's prefill, which goes through the model's general forward, then takes
    the same oneDNN products as its decode step (`--rollout-onednn`) without the model's code
    knowing. Any other call passes through unchanged."""

    def __init__(self, table: dict[int, PackedLinear]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            packed = self.table.get(id(args[1] if len(args) > 1 else kwargs["weight"]))
            if packed is not None:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return packed(args[0] if args else kwargs["input"], bias)
        return func(*args, **kwargs)


def prefill_packs(model: Transformer, rows: int, shared: list[PackedLinear]) -> dict[int, PackedLinear]:
    """oneDNN packs for the general forward's projections (by weight identity), each where its
    shape measures faster at `rows` rows; `shared`: packs of the decode step to reuse where they
    hold the same weight (o, down, the LM head), so only the fused ones get a second copy."""
    weights = {id(module.weight): module.weight for module in projections(model)}
    table = {id(p.weight): p for p in shared if p.kind == "onednn" and id(p.weight) in weights}
    for key, w in weights.items():
        if key not in table and packing_pays(rows, tuple(w.shape), "onednn"):
            table[key] = PackedLinear(w, [w], rows, "onednn")
    return table


def _plain(weight: torch.Tensor, sources: list[torch.Tensor], rows: int | None, kind: str = "mkl"):
    """The projection `x -> F.linear(x, weight)`, packed (`kind`) for `rows` rows when given; on
    oneDNN only where that measures faster at this weight's shape (MKL is measured once for
    the whole model, by the caller)."""
    if rows is not None and (kind == "mkl" or packing_pays(rows, tuple(weight.shape), kind)):
        return PackedLinear(weight, sources, rows, kind)
    return lambda x, bias=None: F.linear(x, weight, bias)


class _Layer:
    """One decoder layer's fused weights and modules."""

    def __init__(self, layer: nn.Module, rows: int | None, kind: str = "mkl") -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.groups: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        self.qkv_sources = [p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv = self._fuse(self.qkv_sources)
        self.qkv_bias = (
            None
            if attn.q_proj.bias is None
            else self._fuse([p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        )
        self.moe = isinstance(mlp, MoE)
        if self.moe:
            experts = list(mlp.experts)
            E, inner = len(experts), experts[0].gate_proj.out_features
            self.gate_up_sources = [w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight)]
            self.down_sources = [e.down_proj.weight for e in experts]
            self.gate_up = self._fuse(self.gate_up_sources).view(E, 2 * inner, -1)  # (E, 2I, hidden)
            self.down = self._fuse(self.down_sources).view(E, -1, inner)  # (E, hidden, I)
        else:
            self.gate_up_sources = [mlp.gate_proj.weight, mlp.up_proj.weight]
            self.down_sources = [mlp.down_proj.weight]
            self.gate_up = self._fuse(self.gate_up_sources)  # (2I, hidden)
            self.down = mlp.down_proj.weight
        # the projections every row goes through, packed for a full batch when asked
        self.qkv_proj = _plain(self.qkv, self.qkv_sources, rows, kind)
        self.o_proj = _plain(attn.o_proj.weight, [attn.o_proj.weight], rows, kind)
        if self.moe:
            self.router = _plain(mlp.gate.weight, [mlp.gate.weight], rows, kind)
            self.row_projections = [self.qkv_proj, self.o_proj, self.router]
        else:
            self.gate_up_proj = _plain(self.gate_up, self.gate_up_sources, rows, kind)
            self.down_proj = _plain(self.down, self.down_sources, rows, kind)
            self.row_projections = [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]

    def _fuse(self, params: list[nn.Parameter]) -> torch.Tensor:
        fused = fuse(params)
        self.groups.append((fused, params))
        return fused

    def intact(self) -> bool:
        """Whether every fused parameter still lives in its fused tensor (a parameter replaced
        rather than copied into would leave this step reading stale weights)."""
        return all(
            p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            for fused, params in self.groups
            for p in params
        )


class FastDecoder:
    """One decode token for rows [0, B) of a KV cache. Build it once per engine model;
    `packed_rows`: pack the projections for batches of that many rows (CPU with MKL only, where
    it measures faster); `onednn`: run each projection whose shape measures faster there on
    oneDNN with a packed weight instead (CPU; any row count; not F.linear's bits: rounding
    differs by fp32 ulps)."""

    def __init__(self, model: Transformer, packed_rows: int | None = None, onednn: bool = False) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean decode step cannot run this model: {reason}")
        self.model, cfg = model, model.config
        weight = model.lm_head.weight
        self.packing_note, kind = "", "mkl"
        if onednn:
            require_onednn(weight)
            packed_rows, kind = packed_rows or 1, "onednn"
        elif packed_rows is not None and (
            packed_rows < 2 or not mkl_packing_works(weight.device, weight.dtype)
        ):
            packed_rows = None  # one row runs MKL's GEMV, which packs nothing
        if packed_rows is not None and kind == "mkl":
            attn = model.model.layers[0].self_attn
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)  # the fused q/k/v weight's shape
            shape = (sum(p.out_features for p in qkv), attn.q_proj.in_features)
            if not packing_pays(packed_rows, shape):
                packed_rows, self.packing_note = None, f"MKL packing measured no faster at {shape} here"
        self.packed_rows, self.packing = packed_rows, kind if packed_rows is not None else None
        self.layers = [_Layer(layer, packed_rows, kind) for layer in model.model.layers]
        self.lm_head = _plain(weight, [weight], packed_rows, kind)
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )

    def intact(self) -> bool:
        return all(layer.intact() for layer in self.layers)

    @property
    def packed_bytes(self) -> int:
        """Memory of the packed weight copies (0 when nothing is packed)."""
        return sum(p.nbytes for p in self.packed_projections())

    def row_projections(self) -> list:
        """Every projection a decode row goes through (experts aside), packed or not."""
        return [self.lm_head, *(p for layer in self.layers for p in layer.row_projections)]

    def packed_projections(self) -> list[PackedLinear]:
        return [p for p in self.row_projections() if isinstance(p, PackedLinear)]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> ModelOutput:
        """ids, positions (B,) long: one token per cache row 0..B-1 -> logits (B, 1, V) and the
        routing record (B, 1, MoE layers, K), as `Transformer.forward` returns them."""
        model, B = self.model, ids.shape[0]
        length = int(positions.max()) + 1
        if length > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; position {length - 1} asked")
        cos, signed_sin = rope_tables(positions, model.inv_freq)  # (B, 1, D)
        visible = None  # every row at the last position sees every key: no mask to apply
        if bool((positions != length - 1).any()):
            keys = torch.arange(length, device=ids.device)
            visible = (keys[None, :] <= positions[:, None]).view(B, 1, 1, length)
        rows = cache_rows(positions, self.kv_heads, cache.max_len)  # where this step writes k, v
        h = F.embedding(ids, model.model.embed_tokens.weight)  # (B, hidden)
        routed = []
        for index, layer in enumerate(self.layers):
            x = self._norm(layer.in_norm, h)
            attn = self._attention(layer, x, cos, signed_sin, visible, cache, index, rows, positions, length)
            h = h + layer.o_proj(attn, layer.attn.o_proj.bias)
            x = self._norm(layer.post_norm, h)
            if layer.moe:
                h, ids_k = self._moe(layer, x, h)
                routed.append(ids_k)
            else:
                inner = layer.gate_up.shape[0] // 2
                gu = layer.gate_up_proj(x)
                h = h + layer.down_proj(F.silu(gu[:, :inner]) * gu[:, inner:])
        logits = self.lm_head(self._norm(model.model.norm, h)).float()
        experts = torch.stack(routed, dim=1)[:, None] if routed else None
        return ModelOutput(logits=logits[:, None], router_logits=[], routed_experts=experts)

    def _norm(self, norm: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm(x, norm.weight if weight is None else weight, norm.eps)

    def _attention(self, layer, x, cos, signed_sin, visible, cache, index, rows, positions, length):
        B, H, KV, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv_proj(x, layer.qkv_bias).view(B, H + 2 * KV, D)
        qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
        if layer.attn.qk_norm:  # q_norm and k_norm in one pass: one weight row per head
            a = layer.attn
            weight = torch.cat([a.q_norm.weight.expand(H, D), a.k_norm.weight.expand(KV, D)])
            qk = self._norm(a.q_norm, qk, weight)
        qk = apply_rope(qk, cos, signed_sin)  # q and k at once
        q, k = qk[:, :H], qk[:, H:]
        keys, values = cache.keys[index], cache.values[index]
        # one index_copy_ into each (slots*KV*L, D) view: cheaper than advanced-index writes
        keys.view(-1, D).index_copy_(0, rows, k.reshape(B * KV, D))
        values.view(-1, D).index_copy_(0, rows, v.reshape(B * KV, D))
        K, V = keys[:B, :, :length], values[:B, :, :length]  # (B, KV, S, D) views
        scores = torch.matmul(q.reshape(B, KV, H // KV, D), K.transpose(-1, -2)).mul_(D**-0.5)
        if visible is not None:
            scores = scores.masked_fill_(~visible, float("-inf"))
        return torch.matmul(scores.softmax(-1), V).reshape(B, H * D)

    def _moe(self, layer: _Layer, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h + the layer's experts on x; the chosen experts (B, K)."""
        moe: MoE = layer.mlp
        weights, chosen = route(layer.router(x), moe.top_k, moe.norm_topk_prob)
        out = expert_mlp(x, chosen, weights, layer.gate_up, layer.down)
        if moe.shared_expert is not None:
            out = out + moe._shared(x)
        return h + out, chosen
