"""miles models: one transformer for Llama / Qwen2 / Qwen3 / Qwen3-MoE, checkpoints, tokenizers."""

from miles.models.checkpoint import load_model, read_config, save_model
from miles.models.config import ModelConfig, tiny_moe_config
from miles.models.kv_cache import KVCache
from miles.models.linear import default_linear, pattern_factory
from miles.models.tokenizer import byte_tokenizer, load_tokenizer
from miles.models.transformer import ModelOutput, Transformer

__all__ = [
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "byte_tokenizer",
    "default_linear",
    "load_model",
    "load_tokenizer",
    "pattern_factory",
    "read_config",
    "save_model",
    "tiny_moe_config",
]
