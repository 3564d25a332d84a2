"""The model configuration: one dataclass for Llama, Qwen2, Qwen3 and Qwen3-MoE.

Field names follow Hugging Face's `config.json`, so a checkpoint's config maps onto this with
few renames and `to_hf_dict` writes one that `transformers` reads back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from miles.errors import CheckpointError
from miles.models.vision import VisionConfig

# model_type -> (HF architecture class name, defaults that differ between families)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "LlamaForCausalLM", "qk_norm": False, "attention_bias": False},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "qk_norm": False, "attention_bias": True},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qk_norm": True, "attention_bias": False},
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "qk_norm": True, "attention_bias": False},
    "qwen2_moe": {"architecture": "Qwen2MoeForCausalLM", "qk_norm": False, "attention_bias": True},
    "qwen2_vl": {"architecture": "Qwen2VLForConditionalGeneration", "qk_norm": False, "attention_bias": True},
}
MOE_TYPES = {"qwen3_moe", "qwen2_moe"}


@dataclass
class ModelConfig:
    """Sizes and options of a decoder-only transformer (see `docs/models.md`)."""

    model_type: str = "qwen3_moe"
    vocab_size: int = 260
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None: the family's default (Qwen2: True)
    qk_norm: bool | None = None  # None: the family's default (Qwen3: True)
    # Mixture of experts (model_type qwen3_moe / qwen2_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # qwen2_moe: a dense expert every token uses
    # Vision-language (model_type qwen2_vl): the vision tower, M-RoPE and the image tokens
    vision_config: VisionConfig | None = None
    mrope_section: list[int] = field(default_factory=list)  # rotary frequencies for (time, row, column)
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # Special tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise CheckpointError(
                f"model_type {self.model_type!r} is not supported; miles runs {sorted(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[self.model_type]
        if self.attention_bias is None:
            self.attention_bias = family["attention_bias"]
        if self.qk_norm is None:
            self.qk_norm = family["qk_norm"]
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if isinstance(self.vision_config, dict):
            self.vision_config = VisionConfig.from_hf_dict(self.vision_config)
        if self.mrope_section and sum(self.mrope_section) != self.head_dim // 2:
            raise CheckpointError(
                f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}"
            )
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise CheckpointError(
                f"an MoE model needs 0 < num_experts_per_tok <= num_experts, got "
                f"num_experts_per_tok={self.num_experts_per_tok}, num_experts={self.num_experts}"
            )

    def kv_bytes_per_token(self, element_size: int = 4) -> int:
        """Keys and values of one position, every layer, at `element_size` bytes a number."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers: sparse every `decoder_sparse_step` layers, except listed."""
        return (
            self.is_moe
            and self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def out_proj_bias(self) -> bool:
        """Qwen2's attention has q/k/v biases but none on o_proj; Llama/Qwen3 use one flag."""
        return bool(self.attention_bias) and self.model_type not in ("qwen2", "qwen2_moe", "qwen2_vl")

    @property
    def is_vision_language(self) -> bool:
        return self.vision_config is not None

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face config dict; `source` names the file in error messages."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} (architectures={hf.get('architectures')}) is not "
                f"supported; miles runs {sorted(ARCHITECTURES)}"
            )
        if model_type == "qwen2_vl":  # the language model's fields sit in text_config (or at the top, older)
            hf = {**hf, **(hf.get("text_config") or {}), "model_type": "qwen2_vl"}
        required = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ]
        missing = [k for k in required if k not in hf]
        if missing:
            raise CheckpointError(f"{source}: required field(s) {missing} missing")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ("default", None) and not (model_type == "qwen2_vl" and rope_type == "mrope"):
            raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only default RoPE)")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names}
        kwargs["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        if model_type == "qwen2_vl":
            kwargs["mrope_section"] = list(rope.get("mrope_section") or scaling.get("mrope_section") or [])
            kwargs["attention_bias"] = True
        if "num_key_value_heads" not in hf or hf["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        if model_type in MOE_TYPES:
            kwargs["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", 0))
            kwargs.setdefault("mlp_only_layers", [])
        else:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                kwargs.pop(k, None)
        if model_type == "qwen3_moe":
            kwargs["shared_expert_intermediate_size"] = 0
        if model_type == "qwen2_moe":
            kwargs["attention_bias"] = bool(hf.get("qkv_bias", True))
        elif model_type in ("qwen2", "qwen2_vl"):
            kwargs["attention_bias"] = True  # Qwen2 always has q/k/v biases
        elif "attention_bias" not in hf:
            kwargs["attention_bias"] = None
        try:
            return cls(**kwargs)
        except TypeError as e:  # a field of the wrong type
            raise CheckpointError(f"{source}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that `transformers.AutoConfig` reads as the same model."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]["architecture"]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type in ("qwen2", "qwen2_vl"):
            d.pop("attention_bias")
        if self.is_vision_language:
            d["rope_parameters"]["mrope_section"] = list(self.mrope_section)
            text = {
                k: v for k, v in d.items() if k not in ("architectures", "torch_dtype", "tie_word_embeddings")
            }
            d.update(
                text_config={**text, "model_type": "qwen2_vl_text"},
                vision_config=self.vision_config.to_hf_dict(),
                image_token_id=self.image_token_id,
                vision_start_token_id=self.vision_start_token_id,
                vision_end_token_id=self.vision_end_token_id,
            )
        if self.model_type == "qwen2_moe":
            d["qkv_bias"] = d.pop("attention_bias")
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
            if self.model_type == "qwen2_moe":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


# the built-in models' language-model shape: 4 layers, 128 wide, 4 heads over 2 KV heads of 32
TINY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def tiny_moe_config(vocab_size: int = 260) -> ModelConfig:
    """The built-in default: a 1.8M-parameter Qwen3-MoE (8 experts, top-2) that trains on 2 CPU cores."""
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=vocab_size, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, norm_topk_prob=True, **TINY_SHAPE,
    )  # fmt: skip


def tiny_vlm_config() -> ModelConfig:
    """The built-in vision-language model: a Qwen2-VL of the same language-model shape over the
    byte tokenizer with image markers, and a 2-block vision tower (64 wide)."""
    from miles.models.tokenizer import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VISION_IDS

    return ModelConfig(
        model_type="qwen2_vl",
        vocab_size=max(BYTE_VISION_IDS.values()) + 1,
        vision_config=VisionConfig(depth=2, embed_dim=64, hidden_size=128, num_heads=4),
        mrope_section=[4, 6, 6],
        vision_start_token_id=BYTE_VISION_IDS["<|vision_start|>"],
        image_token_id=BYTE_VISION_IDS["<|image_pad|>"],
        vision_end_token_id=BYTE_VISION_IDS["<|vision_end|>"],
        eos_token_id=BYTE_EOS_ID,
        pad_token_id=BYTE_PAD_ID,
        **TINY_SHAPE,
    )
