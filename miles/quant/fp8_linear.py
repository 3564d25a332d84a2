"""`FP8Linear`: one projection computing in FP8 (or bf16 during a precision warm-up), the same
code in the trainer and in the rollout engine, so the two quantize identically.

- Trainer (`store_codes=False`): the fp32 master weight stays a Parameter; the forward quantizes
  weight and input, the backward is a straight-through estimator (the rounding passes the gradient
  unchanged) and quantizes the output gradient: E4M3 with --fp8-format e4m3, E5M2 with hybrid.
- Engine (`store_codes=True`): the weight is stored as float8 codes plus scales (a quarter of the
  fp32 bytes), re-quantized from the fp32 weights of each sync (`load_weight`).
- Delayed scaling (--fp8-recipe delayed): an activation's or gradient's scale comes from the max
  amax of the previous `history` calls instead of its own; weights always use their own amax.
On CPU the GEMM is emulated (quantize -> dequantize -> fp32 matmul); on CUDA a tensorwise engine
layer runs the real `torch._scaled_mm` (on CPU that kernel is ~1000x slower than the emulation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.quant.fp8 import (
    FP8Recipe,
    dequantize,
    fake_quantize,
    fake_quantize_activation,
    quantize,
    round_bf16,
)


@dataclass(frozen=True)
class FP8Spec:
    """The run's FP8 settings: `recipe` blockwise | tensorwise | delayed, `fmt` e4m3 | hybrid,
    `dynamic` (with delayed: each tensor's own amax instead of the history)."""

    recipe: str = "blockwise"
    fp32_scales: bool = False
    fmt: str = "e4m3"
    dynamic: bool = False
    history: int = 16

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed" and not self.dynamic

    def _recipe(self, fmt: str) -> FP8Recipe:
        return FP8Recipe("blockwise" if self.recipe == "blockwise" else "tensorwise", self.fp32_scales, fmt)

    @property
    def weights(self) -> FP8Recipe:
        return self._recipe("e4m3")

    @property
    def inputs(self) -> FP8Recipe:
        return self._recipe("e4m3")

    @property
    def grads(self) -> FP8Recipe:
        return self._recipe("e5m2" if self.fmt == "hybrid" else "e4m3")


class _RoundSTE(torch.autograd.Function):
    """Forward: round (quantize -> dequantize); backward: the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, round_fn):
        return round_fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _QuantizeGrad(torch.autograd.Function):
    """Forward: the identity; backward: the incoming gradient quantized (an FP8 dgrad/wgrad input)."""

    @staticmethod
    def forward(ctx, y, layer):
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layer.quantize_grad(grad), None


class AmaxHistory:
    """The last `n` amax values of one tensor role; the scale of the next call uses their max."""

    def __init__(self, n: int) -> None:
        self.values: deque[float] = deque(maxlen=n)

    def amax(self) -> torch.Tensor | None:
        return torch.tensor(max(self.values)) if self.values else None

    def push(self, x: torch.Tensor) -> None:
        if x.numel():
            self.values.append(float(x.detach().abs().amax()))


class QuantizedLinear(nn.Module):
    """What FP8Linear and Int4Linear share: the bf16/low-precision mode switch, and the trainer's
    rounded weight (straight-through while training, cached between weight updates otherwise).
    A subclass defines `round_weight`, `load_weight` and `dequantized_weight`."""

    mode: str
    store_codes: bool
    _cached: tuple | None = None

    def round_weight(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def set_mode(self, mode: str) -> None:
        """bf16 (precision warm-up) or the low precision; an engine layer converts what it holds
        now (the next weight sync replaces it with the trainer's quantization anyway)."""
        if mode == self.mode:
            return
        if self.store_codes:
            current = self.dequantized_weight()
            self.mode = mode
            self.load_weight(current)
        self.mode, self._cached = mode, None

    def _trainer_weight(self) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _RoundSTE.apply(self.weight, self.round_weight)
        key = (self.weight._version, self.weight.data_ptr(), self.mode)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.round_weight(self.weight.detach()))
        return self._cached[1]


class FP8Linear(QuantizedLinear):
    def __init__(
        self, linear: nn.Linear, spec: FP8Spec, store_codes: bool = False, mode: str = "fp8"
    ) -> None:
        super().__init__()
        self.spec, self.store_codes, self.mode = spec, store_codes, mode
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        if store_codes:  # codes and scales only: the fp32 weight is not kept
            self.register_buffer("weight", torch.empty(0, device=linear.weight.device), persistent=True)
            self.register_buffer(
                "weight_scale", torch.ones((), device=linear.weight.device), persistent=False
            )
            self.load_weight(linear.weight.detach())
        else:
            self.weight = linear.weight
        self.history = {role: AmaxHistory(spec.history) for role in ("input", "grad")}
        self.stats = {"flushed": 0, "saturated": 0, "elements": 0}
        self.track = not store_codes  # the trainer reports fp8_* metrics
        self._cached: tuple | None = None

    # ---- weights ---------------------------------------------------------------------------

    def load_weight(self, tensor: torch.Tensor) -> None:
        """Store an fp32 weight as this engine layer's codes (fp8) or bf16 values (warm-up)."""
        tensor = tensor.detach().to(self.weight.device)
        if self.mode == "bf16":
            self.weight = tensor.to(torch.bfloat16)
            self.weight_scale = torch.ones((), device=tensor.device)
        else:
            self.weight, self.weight_scale = quantize(tensor, self.spec.weights)

    def dequantized_weight(self) -> torch.Tensor:
        if self.mode == "bf16":
            return self.weight.float()
        return dequantize(self.weight, self.weight_scale, self.spec.weights)

    def round_weight(self, w: torch.Tensor) -> torch.Tensor:
        return round_bf16(w) if self.mode == "bf16" else fake_quantize(w, self.spec.weights)

    # ---- activations and gradients ---------------------------------------------------------

    def _round_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "bf16":
            return round_bf16(x)
        amax = self.history["input"].amax() if self.spec.delayed else None
        q = fake_quantize_activation(x, self.spec.inputs, amax)
        if self.track:
            self._count(x, q, amax)
        if self.spec.delayed:
            self.history["input"].push(x)
        return q

    def quantize_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self.mode == "bf16":
            return round_bf16(grad)
        amax = self.history["grad"].amax() if self.spec.delayed else None
        q = fake_quantize_activation(grad, self.spec.grads, amax)
        if self.spec.delayed:
            self.history["grad"].push(grad)
        return q

    def _count(self, x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor | None) -> None:
        x, q = x.detach(), q.detach()
        self.stats["flushed"] += int(((q == 0) & (x != 0)).sum())
        if amax is not None:  # delayed: elements above the history's amax were clipped
            self.stats["saturated"] += int((x.abs() > amax).sum())
        self.stats["elements"] += x.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.store_codes:
            if (
                x.is_cuda
                and self.mode == "fp8"
                and self.spec.recipe == "tensorwise"
                and _scaled_mm_ok(x, self)
            ):
                return _scaled_mm_forward(x, self)
            xq = round_bf16(x) if self.mode == "bf16" else self._round_input(x)
            return F.linear(xq, self.dequantized_weight().to(x.dtype), self.bias)
        y = F.linear(_RoundSTE.apply(x, self._round_input), self._trainer_weight(), self.bias)
        if torch.is_grad_enabled() and y.requires_grad:
            y = _QuantizeGrad.apply(y, self)
        return y

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.spec.recipe}, {self.mode}, store_codes={self.store_codes}"


def _scaled_mm_ok(x: torch.Tensor, layer: FP8Linear) -> bool:
    return x.shape[-1] % 16 == 0 and layer.out_features % 16 == 0


def _scaled_mm_forward(x: torch.Tensor, layer: FP8Linear) -> torch.Tensor:
    """The real FP8 GEMM (tensorwise scales): torch._scaled_mm on the codes."""
    flat = x.reshape(-1, x.shape[-1]).float()
    x_codes, x_scale = quantize(flat, layer.spec.inputs)
    y = scaled_mm(x_codes, x_scale, layer.weight, layer.weight_scale)
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


def scaled_mm(a_codes, a_scale, b_codes, b_scale) -> torch.Tensor:
    """(a * sa) @ (b * sb)^T with tensorwise scales, by torch._scaled_mm (fp32 output)."""
    return torch._scaled_mm(
        a_codes,
        b_codes.t(),
        scale_a=a_scale.float().reshape(()),
        scale_b=b_scale.float().reshape(()),
        out_dtype=torch.float32,
    )
