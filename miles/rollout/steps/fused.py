"""Each decode step and prefill as one C++ call (`--rollout-decode-step fused`, auto's choice on CPU).

At the sizes RL rollout runs on a CPU, a decode step of a small model is about a hundred
operators of a few microseconds each, and each one forks and joins the thread pool
(docs/performance.md). Every row's step is independent of the other
rows' (its own KV-cache slot, its own experts), so `fused.cpp` splits the rows over the
threads once and runs each thread's rows through the whole model: one parallel region a step.
With few rows a thread (SmolLM2 at batch 1 or 16) the threads share each product by 16-column
units of its output instead, so every weight is read once a step. The projections are register-blocked GEMMs
on weights transposed and packed once into contiguous column panels (`pack_panels`), or on
INT4 codes in the same panels (`pack_int4_panels`: a quarter of the fp32 bytes to read), which
each GEMM dequantizes 64 rows at a time into an L1-resident buffer, so an INT4 engine computes
exactly the fp32 step on its grid weights; each MoE layer runs each chosen expert on the rows
that chose it; a prefill is the same call on sequences of many tokens.

The source is compiled on first use (`miles.native`: the system's C++ compiler, a cache on
disk, ctypes).

Rounding: the summation orders differ from ATen's (and the softmax's exponential is a
polynomial to about 1 ulp), so logits match the general forward's to fp32 rounding, not bitwise;
but a row's arithmetic is its own, so its bits do not depend on its batch-mates, the thread
count or the split (tests/test_fused_step.py). Speculative verification is the same call on
rows of k + 1 tokens, with the logits of every token. `train_rollout_logprob_abs_diff` reports the gap
to the trainer in a run. The packed weights are a second copy of every projection, rewritten in
place when a parameter's version moves (a weight update copies into the parameters in place).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.models.kv_cache import KVCache
from miles.models.transformer import ModelOutput, MoE, Transformer
from miles.native import NO_COMPILER, build, compiler
from miles.quant.int4 import unpack_int4
from miles.quant.int4_linear import Int4Linear

log = logging.getLogger("miles")

SOURCE = Path(__file__).with_name("fused.cpp")
# Tokens a thread below which the threads share each product (one read of each weight) rather
# than split the rows: weights streamed from memory (more than STREAMED bytes) are worth sharing
# up to more tokens than weights that stay in cache, where sharing costs a barrier a product.
WIDE_BELOW, WIDE_BELOW_STREAMED, STREAMED = 16, 32, 64 * 1024**2


class _Config(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "hidden", "heads", "kv_heads", "head_dim", "vocab", "layers", "max_len",
            "experts", "top_k", "normalize", "inner", "threads", "wide_below", "every_token",
        )
    ] + [("eps", ctypes.c_double)]  # fmt: skip


class _Weight(ctypes.Structure):  # fused.cpp's FusedWeight: fp32 panels (group 0) or INT4 codes
    _fields_ = [("data", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("group", ctypes.c_int64)]


_WEIGHTS = ("qkv", "o", "gate_up", "down", "shared_gate_up", "shared_down")


class _Layer(ctypes.Structure):  # fused.cpp's FusedLayer, field for field
    _fields_ = [
        (name, ctypes.c_int64 if name.endswith("inner") else _Weight if name in _WEIGHTS else ctypes.c_void_p)
        for name in (
            "in_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "router",
            "gate_up", "down", "keys", "values", "inner", "shared_gate_up", "shared_down", "shared_gate",
            "shared_inner",
        )
    ]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled step, built on first use and cached on disk."""
    lib = build(SOURCE, "fused_step", "the fused decode step")
    lib.miles_fused_forward.restype = None
    lib.miles_fused_forward.argtypes = [ctypes.POINTER(_Config), ctypes.POINTER(_Layer), ctypes.c_int64] + [
        ctypes.c_void_p
    ] * 11
    lib.miles_fused_gemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
    lib.miles_fused_gemm_list.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2
    lib.miles_fused_exp.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _layer_products(layer: nn.Module) -> dict[str, list[list[nn.Module]]]:
    """Each product field of fused.cpp's FusedLayer -> its parts, one after another in the packed
    weight: the whole product (q/k/v together, gate/up together), or one part an expert."""
    a, mlp = layer.self_attn, layer.mlp
    products = {"qkv": [[a.q_proj, a.k_proj, a.v_proj]], "o": [[a.o_proj]]}
    if not isinstance(mlp, MoE):
        return {**products, "gate_up": [[mlp.gate_proj, mlp.up_proj]], "down": [[mlp.down_proj]]}
    products.update(
        router=[[mlp.gate]],
        gate_up=[[e.gate_proj, e.up_proj] for e in mlp.experts],
        down=[[e.down_proj] for e in mlp.experts],
    )
    if mlp.shared_expert is not None:
        shared = mlp.shared_expert
        products.update(
            shared_gate_up=[[shared.gate_proj, shared.up_proj]],
            shared_down=[[shared.down_proj]],
            shared_gate=[[mlp.shared_expert_gate]],
        )
    return products


def _products(model: Transformer):
    """The projections the fused step multiplies by as one product each (every expert's weights
    one after another: one format for all), and the LM head."""
    for layer in model.model.layers:
        for parts in _layer_products(layer).values():
            yield [m for part in parts for m in part]
    yield [model.lm_head]


def _int4_group(module: nn.Module) -> int | None:
    """The group size of an INT4 engine layer the fused step reads (its packed codes, fp32
    activations, whole 16-column units), else None."""
    if not isinstance(module, Int4Linear):
        return None
    if module.store_codes and module.mode == "int4" and not module.kernel and module.out_features % 16 == 0:
        return module.group
    return None


def _product_unsupported(modules: list[nn.Module]) -> str | None:
    """What in one product's layers the fused step does not compute (None: nothing): plain
    fp32 linears, or INT4 engine layers of one group size."""
    if all(type(m) is nn.Linear for m in modules):
        return None
    groups = {_int4_group(m) for m in modules}
    if len(groups) == 1 and None not in groups:
        return None
    odd = next(m for m in modules if type(m) is not nn.Linear)
    if isinstance(odd, Int4Linear) and odd.kernel:
        return "INT4 layers with bf16 activations (--int4-kernel-activations bf16 runs torch's INT4 kernel)"
    return f"projections of type {type(odd).__name__} ({odd.extra_repr()}): FP8, sharded or mixed layers"


def _model_unsupported(model: Transformer) -> str | None:
    """What in the model the fused step does not compute (None: nothing)."""
    if model.config.is_vision_language:
        return "it is a vision-language model (the fused step is text-only)"
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
    for product in _products(model):
        reason = _product_unsupported(product)
        if reason is not None:
            return reason
    return None


def fused_unsupported(model: Transformer) -> str | None:
    """Why the fused step cannot run this model here (None: it can)."""
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        weight = model.lm_head.weight
        return f"it runs on CPU in fp32 (the model is on {weight.device} in {weight.dtype})"
    reason = _model_unsupported(model)
    if reason is not None:
        return reason
    if compiler() is None:
        return NO_COMPILER
    return None


PANEL = 64  # columns of a packed panel (fused.cpp's PANEL)


def pack_panels(weight_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """An (in, out) weight laid out as fused.cpp reads it: column panels of 64, each
    contiguous (in rows of its width), one after another; flat. One copy, into `out` if given."""
    K, N = weight_t.shape
    out = torch.empty(K * N, dtype=weight_t.dtype) if out is None else out
    full = N - N % PANEL
    if full:
        panels = weight_t[:, :full].reshape(K, full // PANEL, PANEL).transpose(0, 1)
        out[: K * full].view(full // PANEL, K, PANEL).copy_(panels)
    if full < N:
        out[K * full :].view(K, N - full).copy_(weight_t[:, full:])
    return out


def _t(weights: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Projection weights (out, in), concatenated along out, as one (in, out) weight packed in
    panels (`pack_panels`), into `out` if given. Where every part but the last fills whole
    panels, each part is packed straight into its own run of panels (no concatenated copy)."""
    weights = [w.detach() for w in weights]
    size = sum(w.numel() for w in weights)
    out = torch.empty(size, dtype=weights[0].dtype) if out is None else out
    if any(w.shape[0] % PANEL for w in weights[:-1]):
        return pack_panels(torch.cat(weights).t(), out)
    start = 0
    for w in weights:
        pack_panels(w.t(), out[start : start + w.numel()])
        start += w.numel()
    return out


def _stackable(parts: list[list[nn.Module]]) -> bool:
    """Whether every part (an expert) has the same fp32 weights, each a whole number of panels."""
    first = parts[0]
    return all(
        len(part) == len(first)
        and all(
            type(m.weight) is type(f.weight)
            and m.weight.dtype == torch.float32
            and m.weight.shape == f.weight.shape
            and m.weight.shape[0] % PANEL == 0
            for m, f in zip(part, first)
        )
        for part in parts
    )


def _pack_experts(parts: list[list[nn.Module]], out: torch.Tensor) -> None:
    """`_t` of each part (an expert's projections) into its run of `out`, all experts in one copy
    a projection: the layout `_t` writes part by part, at a few calls instead of several a part."""
    K, width = parts[0][0].weight.shape[1], sum(m.weight.shape[0] for m in parts[0])
    blocks = out.view(len(parts), width // PANEL, K, PANEL)  # expert e's panels, one after another
    at = 0
    for j in range(len(parts[0])):
        stacked = torch.stack([part[j].weight.detach() for part in parts])  # (E, N, K)
        n = stacked.shape[1] // PANEL
        blocks[:, at : at + n].copy_(stacked.view(len(parts), n, PANEL, K).transpose(2, 3))
        at += n


def pack_int4_panels(codes_t: torch.Tensor) -> torch.Tensor:
    """(in, out) int8 INT4 codes (out a multiple of 16) as fused.cpp reads them: the panels of
    `pack_panels`, each row's 16-column units in 8 bytes, byte b holding column b's code + 8 in
    its low nibble and column b + 8's in its high one; flat uint8."""
    K, N = codes_t.shape
    shifted = (codes_t.to(torch.int16) + 8).to(torch.uint8)
    panels = []
    for n in range(0, N, PANEL):
        units = shifted[:, n : n + PANEL].reshape(K, -1, 2, 8)
        panels.append((units[:, :, 0] | (units[:, :, 1] << 4)).reshape(-1))
    return torch.cat(panels)


def _packed(
    modules: list[nn.Module], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """One product's weight as fused.cpp's FusedWeight reads it: (data, scales, group): fp32
    panels of the concatenated (out, in) weights (into `out` if given), or INT4 codes and their
    scales in panels."""
    group = _int4_group(modules[0])
    if group is None:
        return _t([m.weight for m in modules], out), None, 0
    codes = torch.cat([unpack_int4(m.weight) for m in modules])
    scales = torch.cat([m.weight_scale for m in modules])
    return pack_int4_panels(codes.t()), pack_panels(scales.t().contiguous()), group


class PackedLinear:
    """x @ weight.T through the step's GEMM, the weight packed once (`pack_panels`), the threads
    sharing its panels: for small products at a few rows (a draft's), where torch's own call
    costs several times its arithmetic."""

    def __init__(self, weight: torch.Tensor, threads: int | None = None) -> None:
        self.lib, self.out_features = library(), weight.shape[0]
        self.packed = _t([weight])
        self.threads = threads or torch.get_num_threads()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        sizes = torch.tensor(
            [x.shape[0], x.shape[1], self.out_features, x.data_ptr(), self.packed.data_ptr(), y.data_ptr()]
        )
        pointers = [sizes[i:].data_ptr() for i in range(6)]
        self.lib.miles_fused_gemm_list(1, *pointers, self.threads, 1)
        return y


class FusedStep:
    """The `DecodeStep` of one C++ call (`fused.cpp`) a prefill or a one-token step.
    `threads`: default torch's; `wide_below`: tokens a thread under which the threads share each
    product rather than split the rows (default by the weights' size, see WIDE_BELOW)."""

    name = "fused"

    def __init__(self, model: Transformer, threads: int | None = None, wide_below: int | None = None) -> None:
        reason = fused_unsupported(model)
        if reason is not None:
            raise ValueError(f"the fused decode step cannot run this model: {reason}")
        self.lib = library()
        self.model, cfg = model, model.config
        self.threads = threads or torch.get_num_threads()
        self._params = list(model.parameters())
        self._int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
        if wide_below is None:
            streamed = sum(p.numel() * p.element_size() for p in self._sources()) > STREAMED
            wide_below = WIDE_BELOW_STREAMED if streamed else WIDE_BELOW
        self.wide_below = wide_below
        self._packed_versions: list[int] | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # the packed fp32 copies, by product
        self._experts_at_once: dict[str, bool] = {}  # by product: its experts packed in one copy a projection
        self._pointers = [p.data_ptr() for p in self._sources()]
        self.moe_layers = sum(isinstance(layer.mlp, MoE) for layer in model.model.layers)
        self.top_k = cfg.num_experts_per_tok if self.moe_layers else 1
        self._one_each: tuple[torch.Tensor, torch.Tensor] | None = None

    def _sources(self) -> list[torch.Tensor]:
        """Every tensor the packed copies are made from, as the model holds them now: its
        parameters and its INT4 layers' codes and scales (buffers a weight update replaces)."""
        return [*self._params, *(b for m in self._int4 for b in (m.weight, m.weight_scale))]

    def intact(self) -> bool:
        """Whether every parameter still lives where it did (one replaced rather than copied
        into is a new tensor: the engine builds the step again)."""
        return [p.data_ptr() for p in self._sources()] == self._pointers

    def _versions(self) -> list[int]:
        """Each source tensor's version: a weight update copied into one moves it."""
        return [p._version for p in self._sources()]

    def _pack(self) -> None:
        """The packed weight copies and the per-layer pointer table. A repack (a weight update)
        writes the fp32 copies into the buffers of the last one: no fresh pages to fault in."""
        model, cfg = self.model, self.model.config
        self.keep: list[torch.Tensor] = []  # every tensor a pointer below refers to

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            self.keep.append(t)
            return t.data_ptr()

        def buffer(key: str, modules: list[nn.Module]) -> torch.Tensor | None:
            """The fp32 buffer `key` held at the last pack (None for INT4 codes: made anew)."""
            if _int4_group(modules[0]) is not None:
                return None
            numel = sum(m.weight.numel() for m in modules)
            held = self._buffers.get(key)
            if held is None or held.numel() != numel:
                held = self._buffers[key] = torch.empty(numel)
            return held

        def weight(key: str, parts: list[list[nn.Module]]) -> _Weight:
            """One product, its parts packed one after another (fp32 straight into its buffer)."""
            whole = buffer(key, [m for part in parts for m in part])
            if key not in self._experts_at_once:  # the layout of a product's weights never changes in place
                self._experts_at_once[key] = whole is not None and len(parts) > 1 and _stackable(parts)
            if self._experts_at_once[key]:
                _pack_experts(parts, whole)
                return _Weight(ptr(whole), None, 0)
            packed, start = [], 0
            for part in parts:
                size = sum(m.weight.numel() for m in part)
                packed.append(_packed(part, None if whole is None else whole[start : start + size]))
                start += size
            data = whole if whole is not None else torch.cat([p[0] for p in packed])
            scales = None if packed[0][1] is None else torch.cat([p[1] for p in packed])
            return _Weight(ptr(data), ptr(scales), packed[0][2])

        layers = model.model.layers
        self.table = (_Layer * len(layers))()
        largest = 0
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            q = (a.q_proj, a.k_proj, a.v_proj)
            fields = dict(
                in_norm=ptr(layer.input_layernorm.weight),
                post_norm=ptr(layer.post_attention_layernorm.weight),
                qkv_bias=ptr(None if a.q_proj.bias is None else torch.cat([p.bias for p in q])),
                q_norm=ptr(a.q_norm.weight) if a.qk_norm else None,
                k_norm=ptr(a.k_norm.weight) if a.qk_norm else None,
                o_bias=ptr(a.o_proj.bias),
            )
            for name, parts in _layer_products(layer).items():
                packed = weight(f"{i}.{name}", parts)
                fields[name] = packed if name in _WEIGHTS else packed.data  # router, shared gate: fp32 only
            if isinstance(mlp, MoE):
                inner = mlp.experts[0].gate_proj.out_features
                if mlp.shared_expert is not None:
                    fields["shared_inner"] = mlp.shared_expert.gate_proj.out_features
                    largest = max(largest, fields["shared_inner"])
            else:
                inner = mlp.gate_proj.out_features
            fields["inner"], largest = inner, max(largest, inner)
            for name, value in fields.items():
                setattr(self.table[i], name, value)
        self.embed = model.model.embed_tokens.weight.detach()
        self.final_norm = model.model.norm.weight.detach()
        self.inv_freq = model.inv_freq.detach().float().contiguous()
        self.lm_head = _t([model.lm_head.weight], buffer("lm_head", [model.lm_head]))
        self.config = _Config(
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab=model.lm_head.weight.shape[0],
            layers=len(layers),
            max_len=0,
            experts=cfg.num_experts if self.moe_layers else 0,
            top_k=self.top_k,
            normalize=int(bool(cfg.norm_topk_prob)),
            inner=largest,
            threads=self.threads,
            wide_below=self.wide_below,
            eps=cfg.rms_norm_eps,
        )
        self._packed_versions = self._versions()

    @torch.inference_mode()
    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
        rope_offsets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """ids, positions (B, T) long over cache rows `slots` (default 0..B-1) -> logits (B, T, V)
        and the routing record (B, T, MoE layers, K), as `Transformer.forward` returns them. T > 1
        (speculative verification): row b's T tokens are one sequence from positions[b, 0],
        causal within it. The step reads each row's own slot, so free slots cost nothing."""
        if ids.shape[1] != 1:
            B, T = ids.shape
            logits, routed, hidden = self.forward(
                ids.reshape(-1),
                positions.reshape(-1),
                torch.arange(B + 1) * T,
                torch.arange(B) if slots is None else slots,
                cache,
                every_token=True,
            )
            return ModelOutput(
                logits=logits.view(B, T, -1),
                router_logits=[],
                routed_experts=None if routed is None else routed.view(B, T, *routed.shape[1:]),
                hidden=hidden.view(B, T, -1),
            )
        ids, positions = ids[:, 0], positions[:, 0]
        B = ids.shape[0]
        if self._one_each is None or self._one_each[1].shape[0] != B:
            self._one_each = torch.arange(B + 1), torch.arange(B)  # starts and slots: row b, slot b
        starts, default_slots = self._one_each
        logits, routed, hidden = self.forward(
            ids, positions, starts, default_slots if slots is None else slots, cache
        )
        return ModelOutput(
            logits=logits[:, None],
            router_logits=[],
            routed_experts=None if routed is None else routed[:, None],
            hidden=hidden[:, None],
        )

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        starts: torch.Tensor | None = None,
        vision=None,
    ):
        """Sequences ids (U, T), right-padded to T, of `lengths` tokens from position `starts`
        (default 0), into cache `slots` (U,) -> logits (U, 1, V) of each one's last token and
        the routing record (U, T, MoE layers, K) (padding positions: zeros), as the general
        forward's prefill gives."""
        U, T = ids.shape
        real = torch.arange(T)[None, :] < lengths[:, None]
        offsets = torch.arange(T).expand(U, T)
        positions = (offsets if starts is None else offsets + starts[:, None])[real]
        first = F.pad(lengths.cumsum(0), (1, 0))
        logits, routed, hidden = self.forward(ids[real], positions, first, slots, cache)
        record = None
        if routed is not None:
            record = routed.new_zeros(U, T, *routed.shape[1:])
            record[real] = routed
        return ModelOutput(
            logits=logits[:, None], router_logits=[], routed_experts=record, hidden=hidden[:, None]
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        every_token: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Sequences [0, S), sequence s the tokens [starts[s], starts[s + 1]) of the flat ids and
        positions (N,), written into cache slot slots[s] -> the logits (S, V) of each one's last
        token (`every_token`: (N, V), every token's), the routing (N, MoE layers, K) (None for
        a dense model) and the final-normed hidden states the logits come from (S or N, hidden)."""
        if int(positions.max()) >= cache.max_len:
            raise ValueError(
                f"KV cache holds {cache.max_len} positions; position {int(positions.max())} asked"
            )
        vocab = self.model.model.embed_tokens.weight.shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:  # the C++ side reads embedding rows unchecked
            raise ValueError(f"token ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
        if self._packed_versions != self._versions():
            self._pack()
        for layer, keys, values in zip(self.table, cache.keys, cache.values):
            layer.keys, layer.values = keys.data_ptr(), values.data_ptr()
        self.config.max_len = cache.max_len
        S, N = slots.shape[0], ids.shape[0]
        ids, positions, starts, slots = (
            t.to(torch.long).contiguous() for t in (ids, positions, starts, slots)
        )
        self.config.every_token = int(every_token)
        logits = torch.empty(N if every_token else S, self.config.vocab)
        routed = torch.empty(N, max(self.moe_layers, 1), self.top_k, dtype=torch.long)
        hidden = torch.empty(logits.shape[0], self.config.hidden)
        self.lib.miles_fused_forward(
            ctypes.byref(self.config), self.table, S, starts.data_ptr(), slots.data_ptr(), ids.data_ptr(),
            positions.data_ptr(), self.inv_freq.data_ptr(), self.embed.data_ptr(),
            self.final_norm.data_ptr(), self.lm_head.data_ptr(), logits.data_ptr(), routed.data_ptr(),
            hidden.data_ptr(),
        )  # fmt: skip
        return logits, routed if self.moe_layers else None, hidden
