"""The vision side of a Qwen2-VL-style model: the vision tower, and the 3-D positions (M-RoPE)
its image tokens take in the language model.

An image of (t, h, w) patches (the processor's `image_grid_thw`; `pixel_values` holds one row of
channels x temporal_patch_size x patch x patch numbers per patch) goes through a linear patch
embedding, `depth` pre-norm blocks whose attention sees the patches of its own image only (2-D
rotary positions: half the head rotates by the patch's row, half by its column), and a merger
that joins each 2x2 block of patches into one token of the language model's width. The prompt
holds one `image_token_id` per merged token (the processor expands the placeholder), and those
rows of the embedding are replaced by the merger's outputs, in order.

In the language model every position has three coordinates (time, row, column): text tokens
have the same number in all three, counting on from the previous token; an image's tokens count
(0, row, column) from where the image starts, and the text after it resumes from the largest.
`--mrope-section` splits the rotary frequencies between the three.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.errors import MilesError


@dataclass
class VisionConfig:
    """The vision tower's sizes (Hugging Face's `vision_config` field names)."""

    depth: int = 2
    embed_dim: int = 32
    hidden_size: int = 64  # the language model's width: the merger's output
    num_heads: int = 4
    mlp_ratio: int = 2
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> VisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": d.pop("rope_theta")}
        d["model_type"] = "qwen2_vl_vision"
        return d

    @property
    def patch_numbers(self) -> int:
        """Numbers per patch row of `pixel_values`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PatchEmbed(nn.Module):
    """A (temporal x patch x patch) convolution with stride = kernel: one matmul per patch row."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixel_values.to(weight.dtype) @ weight.reshape(weight.shape[0], -1).T


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # (N, H, D) each
        cos, sin = (t[:, None].float() for t in rope)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outs = [  # each image attends within itself, both directions
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        inner = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1, self.fc2 = nn.Linear(cfg.embed_dim, inner), nn.Linear(inner, cfg.embed_dim)
        if cfg.hidden_act not in ("quick_gelu", "gelu"):
            raise MilesError(f"vision_config.hidden_act {cfg.hidden_act!r}: quick_gelu or gelu is supported")
        self.act = quick_gelu if cfg.hidden_act == "quick_gelu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6), nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn, self.mlp = VisionAttention(cfg), VisionMLP(cfg)

    def forward(self, x, rope, lengths):
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each (merge x merge) block of patches -> one token of the language model's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch, (N, 2), in the order the processor lays patches out: block
    by (merge x merge) block, so the merger's groups are consecutive rows."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class VisionTower(nn.Module):
    """`visual.*` in Hugging Face naming: patch embedding, blocks, merger."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        half = cfg.embed_dim // cfg.num_heads // 2  # rows rotate half of each head, columns the other
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One row of the language model's width per merged token, images in order."""
        cfg = self.cfg
        if pixel_values.shape[-1] != cfg.patch_numbers or pixel_values.shape[0] != int(
            grid_thw.prod(-1).sum()
        ):
            raise MilesError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, but image_grid_thw {grid_thw.tolist()} "
                f"implies ({int(grid_thw.prod(-1).sum())}, {cfg.patch_numbers}): pass the processor's two outputs "
                "of the same call"
            )
        positions = patch_positions(grid_thw.cpu(), cfg.spatial_merge_size).to(pixel_values.device)
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # (N, D/2): rows, then columns
        emb = torch.cat([freqs, freqs], dim=-1)
        rope = (emb.cos(), emb.sin())
        lengths = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)


def merge_image_features(
    embeds: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    image_token_id: int,
    real: torch.Tensor,
) -> torch.Tensor:
    """`embeds` with the rows of image tokens (among the `real` ones, not padding) replaced by
    `features`, in order. A count that differs (the prompt's placeholders not expanded by the
    processor, or pixels of another call) raises: a model that silently runs without its images
    still trains, blind."""
    where = (input_ids == image_token_id) & real
    if int(where.sum()) != features.shape[0]:
        raise MilesError(
            f"the prompt holds {int(where.sum())} image tokens (id {image_token_id}) but the images give "
            f"{features.shape[0]}: the token ids and pixel_values must come from one processor call"
        )
    out = embeds.clone()
    out[where] = features.to(embeds.dtype)
    return out


def mrope_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    grid_thw: torch.Tensor | None,
    image_token_id: int,
    merge: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (3, B, T), delta (B,)): each real token's (time, row, column) position, and
    how far a row's next position lies from its token count (generation continues from there).
    Padding keeps position 0."""
    B, T = input_ids.shape
    positions = torch.zeros(3, B, T, dtype=torch.long, device=input_ids.device)
    grids = iter(grid_thw.tolist() if grid_thw is not None else [])
    deltas = []
    for b in range(B):
        real = attention_mask[b].bool()
        ids = input_ids[b][real].tolist()
        parts, start, i = [], 0, 0
        while i < len(ids):
            j = i
            image = ids[i] == image_token_id
            while j < len(ids) and (ids[j] == image_token_id) == image:
                j += 1
            if not image:
                parts.append(torch.arange(j - i).expand(3, -1) + start)
                start += j - i
            else:
                t, h, w = next(grids)
                hh, ww = h // merge, w // merge
                if t * hh * ww != j - i:
                    raise MilesError(
                        f"row {b}: a run of {j - i} image tokens, but its image (grid {t}x{h}x{w}) gives {t * hh * ww}"
                    )
                tt, rr, cc = torch.meshgrid(
                    torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij"
                )
                parts.append(torch.stack([tt, rr, cc]).reshape(3, -1) + start)
                start += max(h, w) // merge
            i = j
        row = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        positions[:, b, real] = row.to(positions.device)
        deltas.append((int(row.max()) + 1 if row.numel() else 0) - len(ids))
    return positions, torch.tensor(deltas, device=input_ids.device)


@dataclass
class PromptVision:
    """What a prefill of image prompts needs beside the ids: every row's images in order, the
    M-RoPE positions, and each row's offset for the positions it generates after."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    rope_positions: torch.Tensor  # (3, U, T)
    deltas: torch.Tensor  # (U,)


def batch_images(images) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """pixel_values and image_grid_thw of rows' images (dicts or None), concatenated in row order."""
    present = [x for x in images if x is not None]
    if not present:
        return None, None
    return (
        torch.cat([torch.as_tensor(x["pixel_values"]) for x in present]),
        torch.cat([torch.as_tensor(x["image_grid_thw"]).reshape(-1, 3) for x in present]),
    )


def prompt_vision(ids: torch.Tensor, lengths: torch.Tensor, images, config) -> PromptVision | None:
    """The vision inputs of right-padded prompts `ids` (U, T) of `lengths`; None without images."""
    pixel_values, grid = batch_images(images)
    if pixel_values is None:
        return None
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    rope, deltas = mrope_positions(
        ids, mask, grid, config.image_token_id, config.vision_config.spatial_merge_size
    )
    return PromptVision(pixel_values, grid, rope, deltas)
