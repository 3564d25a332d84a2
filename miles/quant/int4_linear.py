"""`Int4Linear`: one projection on the INT4 grid (W4A16), in the trainer and in the rollout engine.

- Trainer (`store_packed=False`): the fp32 master weight stays a Parameter (optimizer, DDP/FSDP
  and checkpoints see nothing new); the forward multiplies by its fake-quantized copy and the
  backward passes the gradient through the rounding unchanged (straight-through). Activations
  stay in full precision.
- Engine (`store_packed=True`): each weight sync (`load_weight`) quantizes the fp32 weight with
  the same function and keeps only the packed codes and scales (~1/8 of the fp32 bytes). With
  fp32 activations (the default) each forward dequantizes them and runs one fp32 matmul: the
  trainer's forward bit for bit. With bf16 activations the CPU INT4 kernel runs on them (in its
  own packed layout): W4A16 as GPU serving runs it, faster, at the cost of bf16 rounding.
- `mode="bf16"`: the precision warm-up (--warmup-precision bf16); weights rounded to bf16.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from miles.quant.fp8 import round_bf16
from miles.quant.fp8_linear import QuantizedLinear
from miles.quant.int4 import (
    dequantize_int4,
    fake_quantize_int4,
    kernel_matmul,
    kernel_ok,
    pack_int4,
    quantize_int4,
    to_kernel_layout,
    unpack_int4,
)


class Int4Linear(QuantizedLinear):
    def __init__(
        self,
        linear: nn.Linear,
        group: int,
        store_packed: bool = False,
        mode: str = "int4",
        activations: str = "fp32",
    ) -> None:
        super().__init__()
        self.group, self.store_codes, self.mode, self.activations = group, store_packed, mode, activations
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        device = linear.weight.device
        # the INT4 kernel with bf16 activations; with fp32 activations, dequantizing the packed codes
        # and one fp32 matmul is exact (the trainer's numbers) and, on CPU, faster than the kernel's fp32 path
        self.kernel = (
            store_packed
            and activations == "bf16"
            and kernel_ok(self.out_features, self.in_features, group, device)
        )
        if store_packed:
            self.register_buffer("weight", torch.empty(0, device=device))
            self.register_buffer("weight_scale", torch.ones((), device=device), persistent=False)
            self.load_weight(linear.weight.detach())
        else:
            self.weight = linear.weight
        self._cached: tuple | None = None

    # ---- weights ---------------------------------------------------------------------------

    def load_weight(self, tensor: torch.Tensor) -> None:
        """Store an fp32 weight as this engine layer's packed INT4 codes (or bf16 in warm-up)."""
        tensor = tensor.detach().to(self.weight.device)
        if self.mode == "bf16":
            self.weight, self.weight_scale = tensor.to(torch.bfloat16), torch.ones((), device=tensor.device)
            return
        codes, scales = quantize_int4(tensor, self.group)
        if self.kernel:
            self.weight, self.weight_scale = to_kernel_layout(codes, scales)
        else:
            self.weight, self.weight_scale = pack_int4(codes), scales

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by (out x in)."""
        if self.mode == "bf16":
            return self.weight.float()
        if self.kernel:  # the kernel applied to the identity gives W^T exactly (x1, +0)
            eye = torch.eye(self.in_features, device=self.weight.device)
            return kernel_matmul(eye, self.weight, self.weight_scale, self.group).t().contiguous()
        return dequantize_int4(unpack_int4(self.weight), self.weight_scale, self.group)

    def round_weight(self, w: torch.Tensor) -> torch.Tensor:
        return round_bf16(w) if self.mode == "bf16" else fake_quantize_int4(w, self.group)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.store_codes:
            return F.linear(x, self._trainer_weight(), self.bias)
        if self.mode == "int4" and self.kernel:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = kernel_matmul(flat, self.weight, self.weight_scale, self.group).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        where = "kernel" if self.kernel else ("packed" if self.store_codes else "fake-quant")
        return f"{self.in_features}, {self.out_features}, group={self.group}, {self.mode}, {where}"
