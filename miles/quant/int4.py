"""INT4 weights: symmetric, one scale per 1 x G group along the input dimension.

For a weight W (out x in) and group size G: s = max(amax(group) / 7, 1e-5), q = clamp(round(W / s),
-7, 7), and the weight the layer computes with is q * s. Training fake-quantizes (this rounding in
the forward, the identity in the backward); the rollout engine stores q packed two per byte with
the scales and multiplies by them with a real INT4 kernel where the platform has one, so the
trainer and the engine compute with the same grid.

Packed storage (`pack_int4`): byte j of a row holds q[2j] + 8 in its low nibble and q[2j+1] + 8 in
its high nibble. The CPU kernel (`torch._weight_int4pack_mm_for_cpu`) wants its own tiled layout,
made from the shifted codes by `torch._convert_weight_to_int4pack_for_cpu`; it computes
(code - 8) * scale + zero per group, so the symmetric grid is the zero point 0. It takes groups of
32, 64, 128 or 256 and an output size that is a multiple of 16. With bf16 activations it is the
fast path (W4A16, output rounded to bf16); its fp32-activation path matches the fake-quant matmul
to ~1e-6 but is unvectorized here (10-100x slower than dequantizing and one fp32 matmul).
"""

from __future__ import annotations

import torch

QMAX = 7
SCALE_FLOOR = 1e-5
KERNEL_GROUPS = (32, 64, 128, 256)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"INT4 group size {group} does not divide the input size {cols}")
    return w.reshape(rows, cols // group, group)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 in [-7, 7], shape of w; scales fp32, one per group: out x in/G)."""
    g = _grouped(w.detach().float(), group)
    scales = (g.abs().amax(dim=-1) / QMAX).clamp(min=SCALE_FLOOR)
    codes = torch.clamp(torch.round(g / scales[..., None]), -QMAX, QMAX).to(torch.int8)
    return codes.reshape(w.shape), scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return (_grouped(codes.float(), group) * scales[..., None]).reshape(codes.shape)


def fake_quantize_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """The weight on the INT4 grid, in w's dtype: what both trainer and engine multiply by."""
    return dequantize_int4(*quantize_int4(w, group), group).to(w.dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (rows x even cols) -> uint8 (rows x cols/2), two shifted codes per byte."""
    shifted = (codes.to(torch.int16) + 8).to(torch.uint8)
    return shifted[:, 0::2] | (shifted[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 (rows x cols/2) -> int8 codes (rows x cols)."""
    low, high = (packed & 0xF).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def kernel_ok(out_features: int, in_features: int, group: int, device: torch.device) -> bool:
    """Whether the CPU INT4 kernel takes this layer (else the engine dequantizes the packed codes)."""
    return (
        device.type == "cpu"
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        and group in KERNEL_GROUPS
        and out_features % 16 == 0
        and in_features % group == 0
    )


def to_kernel_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the CPU kernel's packed weight, its scales_and_zeros: in/G x out x 2, zero points 0)."""
    packed = torch._convert_weight_to_int4pack_for_cpu((codes.to(torch.int32) + 8).contiguous(), 1)
    scales_t = scales.t().contiguous()
    return packed, torch.stack((scales_t, torch.zeros_like(scales_t)), dim=-1).contiguous()


def kernel_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x (rows x in, fp32 or bf16) @ W^T by the INT4 kernel, in x's dtype."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros.to(x.dtype))


def divisors(sizes: list[int], smallest: int = 16) -> list[int]:
    """Group sizes (>= `smallest`) that divide every size in `sizes`."""
    if not sizes:
        return []
    return [g for g in range(smallest, min(sizes) + 1) if all(s % g == 0 for s in sizes)]
