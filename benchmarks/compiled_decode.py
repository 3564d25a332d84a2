"""What a whole decode step compiled by torch.compile (inductor, CPU) would give, against the
engine's lean eager step (miles/rollout/fast_decode.py), on the same cache and weights.

    .venv/bin/python benchmarks/compiled_decode.py [--model tiny|smollm2] [--batch 64]

The compiled step has fixed shapes (batch, and the KV length padded to the cache's size with a
mask), takes the weights as inputs (a weight update does not recompile), writes the KV cache in
place, and runs MoE experts densely (every expert on every row, weighted by the routing: no
data-dependent shapes; fine at 8 experts and top-2, wasteful at 128). Printed: compile time,
ms per step of each, and the largest logit difference (fused kernels round differently).
This is a measurement for the design, not an engine path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from miles.models import registry
from miles.models.transformer import MoE, rope_cos_sin
from miles.rollout import Engine


def layer_weights(decoder) -> list[dict[str, torch.Tensor]]:
    out = []
    for layer in decoder.layers:
        w = dict(
            inw=layer.in_norm.weight, qkv=layer.qkv, o=layer.attn.o_proj.weight, pw=layer.post_norm.weight
        )
        if layer.attn.qk_norm:
            w.update(qn=layer.attn.q_norm.weight, kn=layer.attn.k_norm.weight)
        if isinstance(layer.mlp, MoE):
            E, inner = layer.down.shape[0], layer.down.shape[-1]
            w.update(router=layer.mlp.gate.weight, gu=layer.gate_up.view(E * 2 * inner, -1), down=layer.down)
        else:
            w.update(gu=layer.gate_up, down=layer.down)
        out.append(w)
    return out


def make_step(cfg, batch: int, length: int):
    H, KV, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def step(ids, positions, keys, values, weights, embed, final_norm, inv_freq):
        cos, sin = rope_cos_sin(positions[:, None], inv_freq)
        half = D // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        visible = (torch.arange(length)[None, :] <= positions[:, None]).view(batch, 1, 1, length)
        rows = ((torch.arange(batch)[:, None] * KV + torch.arange(KV)) * length + positions[:, None]).reshape(
            -1
        )
        h = F.embedding(ids, embed)
        for i, w in enumerate(weights):
            qkv = F.linear(norm(h, w["inw"]), w["qkv"]).view(batch, H + 2 * KV, D)
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if "qn" in w:
                qk = torch.cat([norm(qk[:, :H], w["qn"]), norm(qk[:, H:], w["kn"])], 1)
            qk = qk * cos + qk.roll(half, dims=-1) * signed_sin
            q, k = qk[:, :H], qk[:, H:]
            keys[i].view(-1, D).index_copy_(0, rows, k.reshape(batch * KV, D))
            values[i].view(-1, D).index_copy_(0, rows, v.reshape(batch * KV, D))
            scores = torch.matmul(q.reshape(batch, KV, H // KV, D), keys[i].transpose(-1, -2)) * D**-0.5
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            h = h + F.linear(torch.matmul(probs, values[i]).reshape(batch, H * D), w["o"])
            x = norm(h, w["pw"])
            if "router" in w:  # dense experts, weighted by the top-k routing
                E, inner = w["down"].shape[0], w["down"].shape[-1]
                chosen_p, chosen = torch.softmax(F.linear(x, w["router"]), -1).topk(
                    cfg.num_experts_per_tok, -1
                )
                if cfg.norm_topk_prob:
                    chosen_p = chosen_p / chosen_p.sum(-1, keepdim=True)
                dense = torch.zeros(batch, E).scatter(1, chosen, chosen_p)
                gu = F.linear(x, w["gu"]).view(batch, E, 2 * inner)
                act = F.silu(gu[..., :inner]) * gu[..., inner:] * dense[:, :, None]
                h = h + torch.bmm(act.transpose(0, 1), w["down"].transpose(1, 2)).sum(0)
            else:
                inner = w["down"].shape[1]
                gu = F.linear(x, w["gu"])
                h = h + F.linear(F.silu(gu[:, :inner]) * gu[:, inner:], w["down"])
        return F.linear(norm(h, final_norm), embed if cfg.tie_word_embeddings else None)

    return step


def median_ms(fn, calls: int = 20, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128, help="KV positions (the padded length)")
    args = parser.parse_args()
    model, tok = registry.load(args.model)
    if not model.config.tie_word_embeddings:
        raise SystemExit("this measurement assumes tied embeddings (tiny, smollm2)")
    engine = Engine(model.eval(), tok, args.batch, max_seq_len=args.length, packed_gemm=False)
    decoder, cache = engine._fast, engine.cache
    ids = torch.randint(0, model.config.vocab_size, (args.batch,))
    positions = torch.randint(args.length // 4, args.length - 1, (args.batch,))
    inputs = (
        ids,
        positions,
        cache.keys,
        cache.values,
        layer_weights(decoder),
        model.model.embed_tokens.weight,
    )
    inputs += (model.model.norm.weight, model.inv_freq)
    step = make_step(model.config, args.batch, args.length)
    with torch.inference_mode():
        lean = decoder(ids, positions, cache).logits[:, 0]
        compiled = torch.compile(step)
        t0 = time.perf_counter()
        got = compiled(*inputs)
        compile_s = time.perf_counter() - t0
        print(
            f"{args.model}, batch {args.batch}, {args.length} KV positions: compile {compile_s:.1f} s; "
            f"lean eager {median_ms(lambda: decoder(ids, positions, cache)):.2f} ms/step, "
            f"compiled {median_ms(lambda: compiled(*inputs)):.2f} ms/step; "
            f"largest logit difference {(got - lean).abs().max():.1e}"
        )


if __name__ == "__main__":
    main()
