"""The lean decode step compiled whole by `torch.compile` (`--rollout-compile`, off by default).

On a CPU the eager step costs about as much in per-operator overhead as in arithmetic
(docs/performance.md); inductor fuses the elementwise work of a step into a few C++ loops and
keeps the larger GEMMs on MKL. Measured (docs/performance.md, 2 cores): the tiny MoE at batch 64,
5.3 -> 3.2 ms a step on one VM; SmolLM2-135M at batch 1, 58.8 -> 21.6 ms on another, whose
MKL GEMV is slow. The price:

- compile time, once per KV-length bucket (`LENGTH_BUCKET` positions): 5-20 s for the tiny MoE
  and 25-85 s for SmolLM2 on 2 cores (inductor's cache brings a repeat down to a few seconds);
- rounding: fused kernels round differently, so log-probs are no longer bitwise the general
  forward's (logits differ by ~3e-5). `train_rollout_logprob_abs_diff` reports the gap, and
  tests/test_fast_decode.py bounds it;
- fixed shapes: every step runs all engine slots (free ones as dummies) over the bucket's
  positions.

What inductor is given, and why:
- MoE experts: with few experts per chosen one (at most `DENSE_EXPERTS`, e.g. top-2 of 8) every
  expert runs on every row, weighted by the routing, which inductor fuses; on the tiny MoE's
  skewed load it and the sparse form measured within the machine's noise of each other
  (docs/performance.md, "Fourth pass"), and it keeps the graph free of data-dependent shapes.
  With more, the experts stay sparse: the expert MLP (`fast_decode.expert_mlp`, whose batch
  shape depends on the routing) is an opaque custom op (`miles::expert_mlp`) in the graph;
- at a handful of rows (`GEMV_ROWS`), every projection is written as a broadcast multiply and
  a sum over the input dimension, which inductor turns into one vectorized loop that reads each
  weight once at about the rate of a plain sum over memory; MKL's GEMV read at a third of that
  on the CPU of docs/performance.md's third pass;
- the attention stays two batched GEMMs around a fused softmax (written as a multiply and a sum
  it measured no faster);
- with `--rollout-onednn`, past `GEMV_ROWS` rows, each projection whose shape measures faster on
  oneDNN than `F.linear` runs there on a weight packed once (the custom op
  `miles::packed_linear`; repacked when a weight's version moves). Where MKL is slow at these
  sizes (AMD CPUs) that halves SmolLM2's step at batch 16 (docs/performance.md).

Weights are inputs of the compiled graph, not constants: a weight update (an in-place copy into
the parameters, hence into the fused tensors) needs no recompilation.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput
from miles.rollout import fast_decode
from miles.rollout.fast_decode import (
    FastDecoder,
    PackedLinear,
    apply_rope,
    cache_rows,
    expert_mlp,
    require_onednn,
    rms_norm,
    rope_tables,
    route,
)
from miles.rollout.fused_step import compiler

log = logging.getLogger("miles")

LENGTH_BUCKET = 128  # KV positions per compiled shape
_step_ids = itertools.count()
DENSE_EXPERTS = 4  # up to this many experts per chosen one, every expert runs on every row
GEMV_ROWS = 4  # up to this many rows, projections are a multiply and a sum (bandwidth-bound)


@torch.library.custom_op("miles::expert_mlp", mutates_args=())
def _expert_mlp_op(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return expert_mlp(x, chosen, weights, gate_up, down)


@_expert_mlp_op.register_fake
def _(x, chosen, weights, gate_up, down):
    return torch.empty_like(x)


_PACKED: dict[int, PackedLinear] = {}  # the packed projections compiled steps call, by handle
_handles = itertools.count()


@torch.library.custom_op("miles::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return _PACKED[handle](x)


@_packed_linear_op.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


def _register(packed: PackedLinear) -> int:
    handle = next(_handles)
    _PACKED[handle] = packed
    return handle


def _release(handles: list[int]) -> None:
    for handle in handles:
        _PACKED.pop(handle, None)


def _linear(rows: int) -> Callable:
    """F.linear, or at up to GEMV_ROWS rows the same product as a multiply and a sum."""
    if rows > GEMV_ROWS:
        return F.linear

    def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = (x[:, None, :] * w[None]).sum(-1)
        return y if bias is None else y + bias

    return gemv


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on PATH (inductor builds its CPU kernels with one, as the fused
    step does: `fused_step.compiler` looks for it)."""
    return compiler() is not None


def compile_unsupported(decoder: FastDecoder) -> str | None:
    """Why the compiled step cannot run this model here (None: it can)."""
    device = decoder.model.lm_head.weight.device
    if device.type == "cpu" and not has_cpp_compiler():
        return "no C++ compiler on PATH (inductor compiles the CPU step with one)"
    for layer in decoder.layers:
        if layer.moe and layer.mlp.shared_expert is not None:
            return "a shared expert (Qwen2-MoE)"
    return None


def _weights(decoder: FastDecoder) -> list[dict[str, torch.Tensor]]:
    out = []
    for layer in decoder.layers:
        attn = layer.attn
        w = {"in_norm": layer.in_norm.weight, "qkv": layer.qkv, "o": attn.o_proj.weight}
        w["post_norm"] = layer.post_norm.weight
        if layer.qkv_bias is not None:
            w["qkv_bias"] = layer.qkv_bias
        if attn.o_proj.bias is not None:
            w["o_bias"] = attn.o_proj.bias
        if attn.qk_norm:
            w["q_norm"], w["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
        if layer.moe:
            w["router"], w["down"], w["gate_up"] = layer.mlp.gate.weight, layer.down, layer.gate_up
        else:
            w["gate_up"], w["down"] = layer.gate_up, layer.down
        out.append(w)
    return out


def _side_by_side(down: torch.Tensor) -> torch.Tensor:
    """(E, hidden, I) expert down projections as one (hidden, E * I) weight."""
    return down.permute(1, 0, 2).reshape(down.shape[1], -1)


def _packs(decoder: FastDecoder, slots: int, measure: bool) -> dict[tuple[int, str], PackedLinear]:
    """oneDNN-packed projections of the compiled step, by (layer, name); the LM head at layer -1.
    `measure`: only those whose shape measures faster on oneDNN than F.linear at `slots` rows
    (`packing_pays`, once per shape). The dense experts' down projections are packed side by
    side, (hidden, E * I), so that the weighted sum over experts is one GEMM."""
    candidates: dict[tuple[int, str], tuple] = {}
    for i, layer in enumerate(decoder.layers):
        candidates[i, "qkv"] = (layer.qkv, layer.qkv_sources)
        o = layer.attn.o_proj.weight
        candidates[i, "o"] = (o, [o])
        if layer.moe:
            if layer.down.shape[0] <= DENSE_EXPERTS * decoder.model.config.num_experts_per_tok:
                gate_up = layer.gate_up.view(-1, layer.gate_up.shape[-1])
                candidates[i, "gate_up"] = (gate_up, layer.gate_up_sources)
                candidates[i, "down"] = (functools.partial(_side_by_side, layer.down), layer.down_sources)
        else:
            candidates[i, "gate_up"] = (layer.gate_up, layer.gate_up_sources)
            candidates[i, "down"] = (layer.down, layer.down_sources)
    head = decoder.model.lm_head.weight
    candidates[-1, "lm_head"] = (head, [head])
    out = {}
    for key, (weight, sources) in candidates.items():
        shape = tuple((weight() if callable(weight) else weight).shape)
        if not measure or fast_decode.packing_pays(slots, shape, "onednn"):
            out[key] = PackedLinear(weight, sources, slots, "onednn")
    return out


def _step_function(
    decoder: FastDecoder, slots: int, max_len: int, length: int, handles: dict[tuple[int, str], int]
) -> Callable:
    """One decode step over all `slots` rows and KV positions [0, length), shapes fixed;
    `handles`: the projections that run packed (`_packs`), the rest through `_linear`."""
    cfg = decoder.model.config
    H, KV, D, eps = decoder.heads, decoder.kv_heads, decoder.head_dim, cfg.rms_norm_eps
    top_k, normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    G = H // KV

    def project(x, layer: int, name: str, w, bias=None):
        handle = handles.get((layer, name))
        if handle is None:
            return _linear(slots)(x, w, bias)
        y = torch.ops.miles.packed_linear(x, handle, w.shape[0])
        return y if bias is None else y + bias

    def step(ids, positions, keys, values, weights, embed, final_norm, lm_head, inv_freq):
        cos, signed_sin = rope_tables(positions, inv_freq)
        visible = (torch.arange(length)[None, :] <= positions[:, None]).view(slots, 1, 1, length)
        rows = cache_rows(positions, KV, max_len)
        h = F.embedding(ids, embed)
        routed = []
        for i, w in enumerate(weights):
            qkv = project(rms_norm(h, w["in_norm"], eps), i, "qkv", w["qkv"], w.get("qkv_bias")).view(
                slots, H + 2 * KV, D
            )
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if "q_norm" in w:
                qk = torch.cat(
                    [rms_norm(qk[:, :H], w["q_norm"], eps), rms_norm(qk[:, H:], w["k_norm"], eps)], dim=1
                )
            qk = apply_rope(qk, cos, signed_sin)
            q, k = qk[:, :H], qk[:, H:]
            keys[i].view(-1, D).index_copy_(0, rows, k.reshape(slots * KV, D))
            values[i].view(-1, D).index_copy_(0, rows, v.reshape(slots * KV, D))
            K, V = keys[i][:, :, :length], values[i][:, :, :length]  # (slots, KV, S, D)
            scores = torch.matmul(q.reshape(slots, KV, G, D), K.transpose(-1, -2)) * D**-0.5
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            attn = torch.matmul(probs, V)
            h = h + project(attn.reshape(slots, H * D), i, "o", w["o"], w.get("o_bias"))
            x = rms_norm(h, w["post_norm"], eps)
            if "router" in w:
                chosen_p, chosen = route(project(x, i, "router", w["router"]), top_k, normalize)
                experts, inner = w["down"].shape[0], w["down"].shape[-1]
                if experts <= DENSE_EXPERTS * top_k:  # every expert on every row, weighted by the routing
                    dense = torch.zeros(slots, experts, dtype=x.dtype).scatter(
                        1, chosen, chosen_p.to(x.dtype)
                    )
                    gate_up = w["gate_up"].view(experts * 2 * inner, -1)
                    gu = project(x, i, "gate_up", gate_up).view(slots, experts, 2 * inner)
                    act = F.silu(gu[..., :inner]) * gu[..., inner:] * dense[:, :, None]
                    if (i, "down") in handles:  # the experts' down projections side by side
                        h = h + torch.ops.miles.packed_linear(
                            act.reshape(slots, experts * inner), handles[i, "down"], x.shape[-1]
                        )
                    else:
                        h = h + torch.bmm(act.transpose(0, 1), w["down"].transpose(1, 2)).sum(0)
                else:
                    h = h + torch.ops.miles.expert_mlp(x, chosen, chosen_p, w["gate_up"], w["down"])
                routed.append(chosen)
            else:
                inner = w["down"].shape[1]
                gu = project(x, i, "gate_up", w["gate_up"])
                h = h + project(F.silu(gu[:, :inner]) * gu[:, inner:], i, "down", w["down"])
        logits = project(rms_norm(h, final_norm, eps), -1, "lm_head", lm_head).float()
        return logits, (torch.stack(routed, dim=1) if routed else None)

    return step


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own. Dynamo keeps its compiled graphs per code object, and
    every step function shares one: engines, batch sizes and length buckets would pile up on
    it, each call would test their guards in turn, and past dynamo's recompile limit (8) the
    step would silently fall back to eager."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_step_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledDecode:
    """`FastDecoder`'s step compiled per KV-length bucket; called like it. `onednn`
    (--rollout-onednn): past GEMV_ROWS rows, the projections whose shape measures faster on
    oneDNN run there, on weights packed once (`miles::packed_linear`, opaque to inductor)."""

    def __init__(
        self, decoder: FastDecoder, slots: int, max_len: int, onednn: bool = False, measure: bool = True
    ) -> None:
        reason = compile_unsupported(decoder)
        if reason is not None:
            raise ValueError(f"the compiled decode step cannot run this model: {reason}")
        self.decoder, self.slots, self.max_len = decoder, slots, max_len
        model = decoder.model
        self.inputs = (_weights(decoder), model.model.embed_tokens.weight, model.model.norm.weight)
        self.inputs += (model.lm_head.weight, model.inv_freq)
        self.steps: dict[int, Callable] = {}
        self.compile_seconds = 0.0
        if onednn:
            require_onednn(model.lm_head.weight)
        # past GEMV_ROWS (where the multiply-sum form reads faster), each projection whose shape
        # measures faster on oneDNN; `measure=False` (tests, benchmarks): all of them
        self.packed = _packs(decoder, slots, measure) if onednn and slots > GEMV_ROWS else {}
        self.handles = {key: _register(p) for key, p in self.packed.items()}
        weakref.finalize(self, _release, list(self.handles.values()))

    def intact(self) -> bool:
        return self.decoder.intact()

    def _step(self, length: int) -> Callable:
        if length not in self.steps:
            self.steps[length] = torch.compile(
                _own_code(_step_function(self.decoder, self.slots, self.max_len, length, self.handles))
            )
        return self.steps[length]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> ModelOutput:
        B = ids.shape[0]
        need = int(positions.max()) + 1
        if need > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; position {need - 1} asked")
        length = min(cache.max_len, -(-need // LENGTH_BUCKET) * LENGTH_BUCKET)
        # free slots run a dummy token at position 0, as in the engine's span; padded even by 0
        # rows, so the inputs are always made here under inference mode (a tensor made outside
        # carries another dispatch key, and dynamo would compile the step again for it)
        pad = self.slots - B
        ids, positions = F.pad(ids, (0, pad)), F.pad(positions, (0, pad))
        new = length not in self.steps
        t0 = time.perf_counter()
        logits, routed = self._step(length)(ids, positions, cache.keys, cache.values, *self.inputs)
        if new:
            seconds = time.perf_counter() - t0
            self.compile_seconds += seconds
            log.info("rollout engine: decode step compiled for %d KV positions in %.1f s", length, seconds)
        return ModelOutput(
            logits=logits[:B, None],
            router_logits=[],
            routed_experts=None if routed is None else routed[:B, None],
        )
