"""One decoder-only transformer for Llama, Qwen2, Qwen3 and Qwen3-MoE (and Qwen2-MoE).

Module and parameter names equal Hugging Face's, so a state dict is a checkpoint. The same code
serves the trainer (full sequences, padding by mask) and the rollout engine (incremental decoding
with a `KVCache`). MoE layers report their router logits and chosen experts, and accept forced
experts (routing replay, R3). Shapes: B batch, T tokens, H heads, D head dim, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from miles.errors import MilesError
from miles.models.config import ModelConfig
from miles.models.kv_cache import KVCache, Rows
from miles.models.linear import LinearFactory, default_linear
from miles.models.routing import (
    NO_RECORD,
    RoutingOptions,
    decode_experts,
    dropped,
    encode_dropped,
    invariant_attention,
    keep_within_capacity,
    tiled_apply,
    tiled_linear,
    top_k,
)
from miles.models.row_ops import RMSNorm, apply_rope
from miles.models.vision import VisionTower, merge_image_features, mrope_positions


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, vocab), fp32
    router_logits: list[torch.Tensor]  # per MoE layer, (B, T, E)
    routed_experts: torch.Tensor | None  # (B, T, MoE layers, K) int64, None for dense models
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (B, KV, T, D), if collected
    hidden: torch.Tensor | None = None  # the final-normed hidden states the logits come from (B, T, H)
    token_logprobs: torch.Tensor | None = None  # (N,) log-prob of each asked target (`forward_logprobs`)
    token_entropy: torch.Tensor | None = None  # (N,) entropy at each asked position (`forward_logprobs`)
    head_hidden: torch.Tensor | None = None  # (N, H) with head_rows: the final-normed hidden rows asked for
    # set where router_logits and routed_experts stay in a compact layout (a packed group's prompt
    # once): (B, T) each position's row among their flattened leading dimensions
    routing_rows: torch.Tensor | None = None


@dataclass
class Prefix:
    """Keys/values of shared prompts (per layer, (P, KV, S, D)), which prompt row each batch
    row continues, and which prompt positions are real (P, S)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    rows: torch.Tensor  # (B,) long
    mask: torch.Tensor  # (P, S) bool


@dataclass
class Layout:
    """Where the real tokens of a padded (B, T) batch sit. A pad-free forward runs its per-token
    work (norms, projections, MLP or MoE, the final norm) on these N rows alone, one GEMM a
    projection over every row, and pads only around attention."""

    tokens: torch.Tensor  # (N,) flat positions b * T + t of the real tokens, in order
    B: int
    T: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> Layout:
        B, T = mask.shape
        return cls(mask.reshape(-1).nonzero().squeeze(1), B, T)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, T, ...), zeros at the padding."""
        out = x.new_zeros(self.B * self.T, *x.shape[1:]).index_copy(0, self.tokens, x)
        return out.view(self.B, self.T, *x.shape[1:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...), the real tokens' rows (index_select: its backward is one index_add)."""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.tokens)

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat padded positions (each a real token's) -> their rows among the N."""
        where = torch.full((self.B * self.T,), -1, dtype=torch.long, device=self.tokens.device)
        where[self.tokens] = torch.arange(self.tokens.numel(), device=self.tokens.device)
        rows = where.index_select(0, flat)
        if bool((rows < 0).any()):
            raise ValueError("head_rows names a padding position")
        return rows


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, T, D) for integer positions (B, T); or, M-RoPE, for positions
    (3, B, T) of (time, row, column): `sections` of the D/2 frequencies take each coordinate."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2) or (3, B, T, D/2)
    if positions.dim() == 3:
        parts = freqs.split(sections, dim=-1)
        freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row: q (B, H, 1, D), k/v (B, KV, S, D), mask (B, 1, 1, S)."""
    B, H, _, D = q.shape
    kv = k.shape[1]
    scores = torch.matmul(q.view(B, kv, H // kv, D), k.transpose(-1, -2)) * D**-0.5  # (B, KV, G, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v).view(B, H, 1, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h, qd, kvd = cfg.hidden_size, self.n_heads * cfg.head_dim, self.n_kv * cfg.head_dim
        bias = bool(cfg.attention_bias)
        self.q_proj = make_linear(f"{prefix}.q_proj", h, qd, bias)
        self.k_proj = make_linear(f"{prefix}.k_proj", h, kvd, bias)
        self.v_proj = make_linear(f"{prefix}.v_proj", h, kvd, bias)
        self.o_proj = make_linear(f"{prefix}.o_proj", qd, h, cfg.out_proj_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = bool(cfg.qk_norm)
        self.batch_invariant = False  # blocked attention, bitwise independent of batch and padding

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,  # (B, 1, T, S) bool, True = may attend
        cache: tuple[KVCache, int, Rows, torch.Tensor, int] | None,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # (B, KV, P, D) keys/values before x
        collect_kv: bool = False,  # also return this layer's (k, v) after RoPE
        layout: Layout | None = None,  # x is (N, hidden), the real tokens of this (B, T) layout
    ):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if layout is not None:
            q, k, v = layout.pad(q), layout.pad(k), layout.pad(v)
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)  # (B, H, T, D)
        own_kv = (k, v)
        if prefix_kv is not None:  # a shared prompt computed once for its group (training)
            k, v = torch.cat([prefix_kv[0], k], dim=2), torch.cat([prefix_kv[1], v], dim=2)
        if cache is not None:
            kv_cache, layer, rows, positions, length = cache
            kv_cache.write(layer, rows, positions, k, v)
            k, v = kv_cache.read(layer, rows, length)
        if self.batch_invariant:
            out = invariant_attention(q, k, v, mask)
        elif T == 1:  # decoding: plain matmuls beat the fused kernel at one query per row
            out = decode_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
            )
        out = out.transpose(1, 2).reshape(B, T, -1)
        out = self.o_proj(out if layout is None else layout.pack(out))
        return (out, own_kv) if collect_kv else out


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        self.gate_proj = make_linear(f"{prefix}.gate_proj", hidden, inner, False)
        self.up_proj = make_linear(f"{prefix}.up_proj", hidden, inner, False)
        self.down_proj = make_linear(f"{prefix}.down_proj", inner, hidden, False)
        self.batch_invariant = False  # on fixed row tiles (`tiled_apply`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return tiled_apply(self._swiglu, x)
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Softmax router, top-k experts, optional shared expert (Qwen2-MoE).

    `forced` (N, K) replaces the router's own choice where it is not -1 (routing replay; a
    recorded drop, -(e + 2), is replayed as a drop). Gate weights always come from this router's
    softmax, gathered at the experts used, so the router keeps its gradient under replay.
    `routing` sets capacity and batch invariance (`miles.models.routing`); `expert_parallel`,
    when set, runs the experts sharded over ranks (`miles.train.expert_parallel`); `expert_loader`
    brings offloaded expert weights to the compute device (`miles.train.expert_offload`).
    """

    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = make_linear(f"{prefix}.gate", cfg.hidden_size, cfg.num_experts, False)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size, f"{prefix}.experts.{e}", make_linear)
            for e in range(cfg.num_experts)
        )
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, f"{prefix}.shared_expert", make_linear
            )
            self.shared_expert_gate = make_linear(f"{prefix}.shared_expert_gate", cfg.hidden_size, 1, False)
        self.routing = RoutingOptions()
        self.expert_parallel = None
        self.expert_loader = None

    def forward(
        self,
        x: torch.Tensor,
        forced: torch.Tensor | None,
        valid: torch.Tensor | None = None,
        used: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, hidden), valid (N,) real tokens -> output (N, hidden), router logits (N, E), routing
        record (N, K): expert ids, -(e + 2) for a slot dropped over capacity. `used` (N,) bool: the
        rows whose output anything reads; the experts run on those alone (the others' output is
        0), while every row is routed (the router logits and record stay whole)."""
        opts = self.routing
        logits = tiled_linear(x, self.gate.weight) if opts.deterministic else self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        ids = top_k(probs, self.top_k, opts.deterministic)
        keep = None
        if opts.capacity_factor is not None:
            keep = keep_within_capacity(
                ids, probs.gather(-1, ids), valid, self.num_experts, opts.capacity_factor, opts.drop_policy
            )
        if forced is not None:
            replay = forced != NO_RECORD
            ids = torch.where(replay, decode_experts(forced).to(ids.dtype), ids)
            if keep is not None or dropped(forced).any():
                keep = torch.where(
                    replay, ~dropped(forced), torch.ones_like(replay) if keep is None else keep
                )
        weights = probs.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        slot = torch.arange(x.shape[0] * self.top_k, device=x.device)  # token * top_k + k
        token = slot // self.top_k
        expert, slot_weight = ids.reshape(-1), weights.reshape(-1)
        run = None if keep is None else keep.reshape(-1)
        if used is not None:
            wanted = used.repeat_interleave(self.top_k)
            run = wanted if run is None else run & wanted
        if run is not None:
            slot, token, expert, slot_weight = slot[run], token[run], expert[run], slot_weight[run]
        if self.expert_parallel is not None:
            out = self.expert_parallel.dispatch(self, x, token, expert, slot_weight)
        else:
            out = self._dispatch(x, token, expert, slot_weight, slot if opts.deterministic else None)
        if self.shared_expert is not None:
            out = out + (tiled_apply(self._shared, x) if opts.deterministic else self._shared(x))
        record = ids if keep is None else torch.where(keep, ids, encode_dropped(ids))
        return out, logits, record

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def run_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its rows (through the offload loader when experts live in host memory)."""
        expert = self.experts[str(e)] if isinstance(self.experts, nn.ModuleDict) else self.experts[e]
        if self.expert_loader is not None:
            return self.expert_loader(expert, rows)
        return expert(rows)

    def run_experts(self, rows: torch.Tensor, counts: list[int], experts: list[int]) -> torch.Tensor:
        """Each of `experts` on its slice of `rows` (sliced by `counts`), outputs concatenated.

        Training runs every expert, also on 0 rows: unused ones get zero gradients, not None, so
        data-parallel ranks reduce the same tensors (FSDP2 needs that)."""
        chunks = rows.split(counts)
        outputs = [self.run_expert(e, c) for e, c in zip(experts, chunks) if c.shape[0] or self.training]
        if not outputs:
            return rows.new_zeros(0, rows.shape[-1])
        return torch.cat(outputs)

    def _dispatch(
        self,
        x: torch.Tensor,
        token: torch.Tensor,
        expert: torch.Tensor,
        weight: torch.Tensor,
        slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run each expert once on its slots (token ids `token`, experts `expert`) and sum the
        weighted outputs, shape (N, hidden).

        Slots are sorted by expert so each expert takes one contiguous slice, and a single
        index_add scatters everything back. (Padding every expert to the busiest one for a batched
        matmul was measured slower on CPU: compute-bound, ~2x padded rows.) With `slot` (each
        slot's token * top_k + k; batch-invariant routing) each token's outputs are summed in k
        order instead: CUDA's index_add adds with atomics, in no fixed order.
        """
        order = expert.argsort(stable=True)
        token = token[order]
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        # one gather, then views per expert: the backward is one index_add and one cat, not a
        # full-size zero tensor per expert as with x[token[slice]]
        y = self.run_experts(x.index_select(0, token), counts, list(range(self.num_experts)))
        y = y * weight[order, None]
        if slot is None:
            return torch.zeros_like(x).index_add_(0, token, y)
        per_slot = x.new_zeros(x.shape[0] * self.top_k, x.shape[1]).index_copy(0, slot[order], y)
        per_slot = per_slot.view(x.shape[0], self.top_k, x.shape[1])
        out = per_slot[:, 0]
        for k in range(1, self.top_k):
            out = out + per_slot[:, k]
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, make_linear: LinearFactory) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", make_linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.mlp = MoE(cfg, f"{prefix}.mlp", make_linear)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp", make_linear)

    def forward(self, h, rope, mask, cache, before, collect_kv: bool, forced, valid, layout=None, used=None):
        """The residual stream h (B, T, hidden), or (N, hidden) with a `layout`, through attention
        and MLP/MoE -> (h, this layer's (k, v) when collected, router logits (..., E) and routing
        record (..., K) of a MoE layer, shaped as h). `used` (rows of h flattened, distinct): the
        only rows of the output read afterwards (the last layer of a forward whose head reads a
        few rows): the MLP or the experts run on those alone, the other rows keep h + attention."""
        attn = self.self_attn(self.input_layernorm(h), rope, mask, cache, before, collect_kv, layout)
        pair = None
        if collect_kv:
            attn, pair = attn
        h = h + attn
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            if used is None:
                return h + self.mlp(x), pair, None, None
            flat = x.reshape(-1, x.shape[-1])
            y = torch.zeros_like(flat).index_copy(0, used, self.mlp(flat.index_select(0, used)))
            return h + y.view_as(h), pair, None, None
        lead = h.shape[:-1]
        rows = None
        if used is not None:
            rows = torch.zeros(lead.numel(), dtype=torch.bool, device=h.device).index_fill_(0, used, True)
        y, logits, ids = self.mlp(x.reshape(-1, x.shape[-1]), forced, valid, rows)
        # explicit widths: a pass of no tokens (every response one token long) has no -1 to infer
        y, logits, ids = (t.view(*lead, t.shape[-1]) for t in (y, logits, ids))
        return h + y, pair, logits, ids


class Backbone(nn.Module):
    """`model.*` in Hugging Face naming: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, make_linear) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (derived from the config, never stored in checkpoints)."""
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))


class Transformer(nn.Module):
    """A causal LM. `forward` handles padded batches (full sequences) and KV-cache decoding."""

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory = default_linear) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, make_linear)
        self.lm_head = make_linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.is_vision_language:  # full precision: low-precision and LoRA layers leave it alone
            self.visual = VisionTower(cfg.vision_config)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # --recompute-activations: each decoder layer keeps only its input for backward and runs
        # again there (training forwards only; never with a KV cache)
        self.recompute_activations = False

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> Transformer:
        """Random initialisation as in transformers (normal(0, std), norms at 1, biases at 0)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv3d)):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        return self

    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position, every layer, as `new_cache` holds them."""
        cfg = self.config
        return (
            2
            * cfg.num_hidden_layers
            * cfg.num_key_value_heads
            * cfg.head_dim
            * self.lm_head.weight.element_size()
        )

    def new_cache(self, slots: int, max_len: int, device=None, dtype=None) -> KVCache:
        cfg, p = self.config, self.lm_head.weight
        return KVCache(
            cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim,
            device or p.device, dtype or p.dtype,
        )  # fmt: skip

    def embed_for_forwards(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings for a caller that runs several forwards on parts of `input_ids`
        (shared prompts: the prompts, then the responses) and passes each its `inputs_embeds`: one embedding
        backward for all of them instead of a vocabulary-sized gradient each. None where the
        weights are sharded (FSDP2 gathers them inside forward only): each forward embeds."""
        weight = self.model.embed_tokens.weight
        if hasattr(weight, "to_local"):  # a DTensor
            return None
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T), 1 = real token (full-sequence mode)
        positions: torch.Tensor | None = None,  # (B, T); default: count of real tokens before
        cache: KVCache | None = None,
        cache_rows: Rows = slice(None),
        forced_experts: torch.Tensor | None = None,  # (B, T, MoE layers, K); -1 = router chooses
        logits_at: torch.Tensor | None = None,  # (B,) one position per row: logits (B, 1, V) only there
        prefix: Prefix | None = None,
        collect_kv: bool = False,
        token_mask: torch.Tensor
        | None = None,  # (B, T) real tokens for MoE capacity (default: attention_mask)
        head_rows: torch.Tensor | None = None,  # (N,) flat positions b * T + t: their hidden rows, no logits
        inputs_embeds: torch.Tensor | None = None,  # (B, T, H) the token embeddings, computed by the caller
        pixel_values: torch.Tensor | None = None,  # vision-language: (patches, numbers per patch), all images
        image_grid_thw: torch.Tensor | None = None,  # (images, 3): each image's (t, h, w) in patches
        rope_positions: torch.Tensor
        | None = None,  # M-RoPE (3, B, T); default: from the images, else positions
        pad_free: bool = False,  # full sequences: per-token work on the real tokens alone (`Layout`)
        attend: torch.Tensor | None = None,  # (B, T, T) bool: who may attend whom (default: causal)
    ) -> ModelOutput:
        """Logits for every position.

        Without `cache`: a padded batch (left or right padding) attends causally among its real
        tokens. With `cache`: the tokens are written at `positions` into `cache_rows` and attend to
        every cached position up to their own (pad tokens must take positions after the real ones).
        With `prefix` (training on groups that share a prompt): row b first attends to the keys
        and values of prefix row `prefix.rows[b]`, collected by an earlier `collect_kv=True` pass,
        so a prompt is computed once per group and its gradient sums over the group. With
        `attend` (full sequences), who may attend whom replaces the causal rule, among each row's
        real tokens (a packed group: each response its prompt and itself).
        `pad_free` (full sequences): everything but attention runs on the real tokens alone, one
        GEMM a projection over all of them; padding positions' outputs are zeros.
        """
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        attention_mask = attention_mask.bool()
        if positions is None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if cache is None:
            idx = torch.arange(T, device=device)
            causal = (idx[None, :] <= idx[:, None])[None] if attend is None else attend
            mask = causal & attention_mask[:, None, :]
            mask = mask | torch.eye(T, dtype=torch.bool, device=device)  # pad rows: no empty softmax
            if prefix is not None:
                seen = prefix.mask[prefix.rows][:, None, :].expand(B, T, -1)
                mask = torch.cat([seen, mask], dim=-1)  # (B, T, P + T)
            length = T
        else:
            length = int(positions.max()) + 1
            mask = torch.arange(length, device=device)[None, None, :] <= positions[:, :, None]
        mask = mask[:, None]  # (B, 1, T, S)
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if cache is None and T > 1 and not any(la.self_attn.batch_invariant for la in self.model.layers):
            # fused attention reads a boolean mask as this additive one, which it would build
            # again in every layer's forward and backward: build it once
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=device).masked_fill_(~mask, float("-inf"))
        cfg = self.config
        # a prompt forward (a decode step feeds sampled tokens, and a sampled image marker ends
        # its response): image tokens without pixels would run the model blind
        prompt = cache is None or T > 1
        if (
            cfg.is_vision_language
            and pixel_values is None
            and prompt
            and bool(((input_ids == cfg.image_token_id) & attention_mask).any())
        ):
            raise MilesError(
                f"the input holds image tokens (id {cfg.image_token_id}) but no pixel_values: the images of a "
                "prompt must travel with its tokens (Sample.multimodal_train_inputs)"
            )
        if pixel_values is not None:
            features = self.visual(pixel_values, image_grid_thw)
            h = merge_image_features(h, input_ids, features, cfg.image_token_id, attention_mask)
            if rope_positions is None:
                merge = cfg.vision_config.spatial_merge_size
                rope_positions, _ = mrope_positions(
                    input_ids, attention_mask, image_grid_thw, cfg.image_token_id, merge
                )
        # text alone: the three coordinates agree, and M-RoPE is the plain rotation of `positions`
        rope = rope_cos_sin(
            positions if rope_positions is None else rope_positions, self.inv_freq, cfg.mrope_section
        )

        valid = (token_mask if token_mask is not None else attention_mask).reshape(-1).bool()
        layout = None
        if pad_free:
            if cache is not None or logits_at is not None:
                raise ValueError("pad_free runs full sequences: no cache, no logits_at")
            layout = Layout.of(attention_mask)
            h, valid = layout.pack(h), valid.index_select(0, layout.tokens)
        router_logits, routed = [], []
        kv: list | None = [] if collect_kv else None  # returned, not passed in: FSDP2 rebuilds arguments
        head_at = None  # the rows of h that the head reads
        if head_rows is not None:
            head_at = head_rows if layout is None else layout.rows_of(head_rows)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else (cache, i, cache_rows, positions, length)
            before = None
            if prefix is not None:
                before = tuple(t.index_select(0, prefix.rows) for t in prefix.kv[i])
            forced = None
            if forced_experts is not None and layer.is_moe:
                forced = forced_experts[:, :, len(routed)].reshape(B * T, -1)
                forced = forced if layout is None else forced.index_select(0, layout.tokens)
            # past the last layer only the head's rows are read: its MLP runs on those alone
            used = head_at.unique() if head_at is not None and i == last else None
            args = (h, rope, mask, layer_cache, before, collect_kv, forced, valid, layout, used)
            if self.recompute_activations and cache is None and torch.is_grad_enabled():
                h, pair, logits, ids = checkpoint(layer, *args, use_reentrant=False)
            else:
                h, pair, logits, ids = layer(*args)
            if collect_kv:
                kv.append(pair)
            if layer.is_moe:
                router_logits.append(logits)
                routed.append(ids)
        if logits_at is not None:  # generation needs the last position only: skip the big lm_head matmul
            h = h[torch.arange(B, device=device), logits_at][:, None]
        hidden = self.model.norm(h)
        if layout is not None:
            router_logits, routed = [layout.pad(t) for t in router_logits], [layout.pad(t) for t in routed]
        experts = torch.stack(routed, dim=2) if routed else None
        if head_rows is not None:  # the caller runs the LM head on these rows (training: responses only)
            if layout is not None:
                return ModelOutput(
                    None, router_logits, experts, kv, head_hidden=hidden.index_select(0, head_at)
                )
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, head_at)
            return ModelOutput(None, router_logits, experts, kv, head_hidden=rows)
        if layout is not None:
            hidden = layout.pad(hidden)
        logits = self.lm_head(hidden).float()
        return ModelOutput(logits, router_logits, experts, kv=kv, hidden=hidden)
