"""Physical limits of one decode step on this machine, measured in the same run as the engine.

- bandwidth bound: the bytes a step must read (every weight once, plus the filled KV cache) at
  the machine's memory bandwidth: the faster of a 256 MB copy (read + write counted) and a
  256 MB sum (a read alone, which is what a decode step does to its weights);
- GEMM bound: the step's matrix multiplies alone (q/k/v and gate/up fused, experts on a balanced
  share of the rows), run back to back over the model's own weights, so cache misses count; the
  faster of plain `F.linear` and the fused step's own register-blocked GEMM (all of the step's
  products in one C++ call, each one's rows or its weight panels split over the threads, the two
  ways the step splits them: the step's products with no per-call cost at all).

The tighter bound is the larger of the two times. Used by rollout_throughput.py and
decode_profile.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models.transformer import MoE, Transformer
from miles.rollout.steps import fused as fused_step


def _best_seconds(fn, tries: int = 5) -> float:
    """The fastest of `tries` timed calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MB tensor copy (read + write counted once each), best of 5."""
    a = torch.empty(64 * 1024**2, dtype=torch.float32)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _best_seconds(lambda: b.copy_(a))


def read_bandwidth() -> float:
    """Bytes per second of summing a 256 MB tensor (one read of every byte), best of 5."""
    a = torch.ones(64 * 1024**2, dtype=torch.float32)
    return a.numel() * 4 / _best_seconds(a.sum)


def memory_bandwidth() -> tuple[float, float, float]:
    """(the bandwidth the bound uses, copy, read): the faster of the two, so the bound stays a
    limit whichever way this machine moves bytes faster."""
    copy, read = copy_bandwidth(), read_bandwidth()
    return max(copy, read), copy, read


def weight_bytes(model: Transformer) -> int:
    """Bytes of the distinct weight tensors (a tied lm_head counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def kv_bytes(model: Transformer, batch: int, context: int) -> int:
    cfg = model.config
    element = model.lm_head.weight.element_size()
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * context * cfg.head_dim * element


def _step_gemms(model: Transformer, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, weight) of each GEMM of one decode step at `batch` rows."""
    cfg, out = model.config, []
    hidden = cfg.hidden_size

    def rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(max(n, 1), width)

    for layer in model.model.layers:
        a = layer.self_attn
        out.append((rows(batch, hidden), torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])))
        out.append((rows(batch, a.o_proj.in_features), a.o_proj.weight))
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            out.append((rows(batch, hidden), mlp.gate.weight))
            share = round(batch * mlp.top_k / mlp.num_experts)
            experts = list(mlp.experts) + ([mlp.shared_expert] if mlp.shared_expert is not None else [])
            for i, e in enumerate(experts):
                n = share if i < mlp.num_experts else batch
                out.append((rows(n, hidden), torch.cat([e.gate_proj.weight, e.up_proj.weight])))
                out.append((rows(n, e.down_proj.in_features), e.down_proj.weight))
        else:
            out.append((rows(batch, hidden), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
            out.append((rows(batch, mlp.down_proj.in_features), mlp.down_proj.weight))
    out.append((rows(batch, hidden), model.lm_head.weight))
    return out


def _fused_gemms(work: list[tuple[torch.Tensor, torch.Tensor]], columns: bool):
    """All of `work`'s products by one call into the fused step's GEMM (weights transposed and
    packed in panels beforehand, as the step keeps them), the threads splitting each product's
    rows or (`columns`) its panels."""
    lib = fused_step.library()
    a = [x.contiguous() for x, _ in work]
    b = [fused_step.pack_panels(w.detach().t()) for _, w in work]
    c = [torch.empty(x.shape[0], w.shape[0]) for x, w in work]
    shapes = [
        torch.tensor(v, dtype=torch.long)
        for v in zip(*[(x.shape[0], x.shape[1], w.shape[0]) for x, w in work])
    ]
    pointers = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.long) for ts in (a, b, c)]
    args = [len(work), *(t.data_ptr() for t in shapes + pointers), torch.get_num_threads(), int(columns)]

    def run() -> tuple:
        lib.miles_fused_gemm_list(*args)
        return a, b, c, shapes, pointers  # alive while `run` is: the call reads their addresses

    return run


def gemm_seconds(model: Transformer, batch: int, repeats: int = 7) -> float:
    """Median time of one decode step's GEMMs alone, back to back: plain F.linear or the fused
    step's GEMM (rows or panels split), the fastest."""
    work = _step_gemms(model, batch)
    runs = {"plain": [lambda x=x, w=w: F.linear(x, w) for x, w in work]}
    if fused_step.compiler() is not None:
        runs["fused step's GEMM, rows split"] = [_fused_gemms(work, columns=False)]
        runs["fused step's GEMM, panels split"] = [_fused_gemms(work, columns=True)]
    best = float("inf")
    with torch.no_grad():
        for calls in runs.values():
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                for call in calls:
                    call()
                times.append(time.perf_counter() - t0)
            best = min(best, statistics.median(times[1:]))
    return best


@dataclass
class Bound:
    bandwidth_s: float  # seconds per step at the memory bandwidth
    gemm_s: float  # seconds per step of the GEMMs alone

    @property
    def tighter_s(self) -> float:
        return max(self.bandwidth_s, self.gemm_s)

    @property
    def which(self) -> str:
        return "bandwidth" if self.bandwidth_s >= self.gemm_s else "GEMM"


def decode_bound(model: Transformer, batch: int, context: int, bandwidth: float) -> Bound:
    nbytes = weight_bytes(model) + kv_bytes(model, batch, context)
    return Bound(nbytes / bandwidth, gemm_seconds(model, batch))
