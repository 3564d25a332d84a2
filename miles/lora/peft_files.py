"""LoRA adapters on disk in PEFT's own format: `adapter_config.json` (written and read by peft's
`LoraConfig`) and `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, so `PeftModel.from_pretrained`
loads what miles saves onto the transformers model, and miles loads what peft trains.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from miles.errors import CheckpointError
from miles.lora.adapters import LoraSpec, adapted, adapter_shape, add_adapters, projections, spec_of
from miles.models.checkpoint import ADAPTER_SUFFIXES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def write_adapter(
    path: str | os.PathLike, named: dict[str, torch.Tensor], spec: LoraSpec, base_model: str = ""
) -> Path:
    """A PEFT adapter directory (into an existing or new directory) from {"<module>.lora_A"/"lora_B": tensor}."""
    from peft import LoraConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = "all-linear" if "all-linear" in spec.targets else list(spec.targets)
    LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
        use_rslora=spec.rslora, task_type="CAUSAL_LM", base_model_name_or_path=base_model,
    ).save_pretrained(str(path))  # fmt: skip
    tensors = {f"{PREFIX}{n}.weight": t.detach().float().contiguous().cpu() for n, t in named.items()}
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    return path


def save_adapter(model: nn.Module, path: str | os.PathLike, base_model: str = "") -> Path:
    """Write the model's adapters as a PEFT adapter directory."""
    spec = spec_of(model)
    assert spec is not None, "save_adapter needs a model with adapters"
    named = {
        f"{name}.{which}": getattr(m, which)
        for name, m in adapted(model).items()
        for which in ADAPTER_SUFFIXES
    }
    return write_adapter(path, named, spec, base_model)


def read_adapter(path: str | os.PathLike) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """(spec, {"<module>.lora_A"/"lora_B": tensor}) of a PEFT adapter directory;
    features miles does not run (DoRA, per-layer ranks, extra trained modules) are refused."""
    from peft import LoraConfig

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir() or not config_file.exists():
        raise CheckpointError(
            f"--lora-adapter-path {path}: expected a PEFT adapter directory holding {CONFIG_FILE}"
        )
    if not weights_file.exists():
        raise CheckpointError(f"{weights_file}: missing (a PEFT adapter keeps its weights there)")
    try:
        raw = json.loads(config_file.read_text())
        config = LoraConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - malformed JSON or not a LoRA config
        raise CheckpointError(
            f"{config_file}: not a PEFT LoRA adapter config ({type(e).__name__}: {e})"
        ) from e
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {raw['peft_type']!r}; miles loads LORA adapters")
    unsupported = [
        key
        for key, off in (
            ("use_dora", False),
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
            ("bias", "none"),
            ("modules_to_save", None),
            ("lora_bias", False),
            ("fan_in_fan_out", False),
            ("target_parameters", None),
            ("layers_to_transform", None),
            ("trainable_token_indices", None),
        )  # fmt: skip
        if raw.get(key) not in (None, off, {}, [])
    ]
    if unsupported:
        raise CheckpointError(
            f"{config_file}: {unsupported[0]} = {raw[unsupported[0]]!r} is not supported by miles"
        )
    try:
        tensors = load_file(weights_file)
    except Exception as e:  # noqa: BLE001 - truncated or not safetensors
        raise CheckpointError(f"{weights_file}: cannot be read as safetensors ({e})") from e
    named = {}
    for key, t in tensors.items():
        name = key.removeprefix(PREFIX)
        for suffix in (
            ".lora_A.weight",
            ".lora_B.weight",
            ".lora_A.default.weight",
            ".lora_B.default.weight",
        ):
            if name.endswith(suffix):
                named[name.removesuffix(suffix) + "." + suffix.split(".")[1]] = t.float()
                break
        else:
            raise CheckpointError(f"{weights_file}: tensor {key!r} is not a LoRA A or B weight")
    modules = tuple(sorted({n.rsplit(".", 1)[0] for n in named}))
    spec = LoraSpec(
        rank=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout or 0.0),
        targets=modules, rslora=bool(config.use_rslora),
    )  # fmt: skip
    return spec, named


def load_adapter(model: nn.Module, path: str | os.PathLike, seed: int = 0) -> LoraSpec:
    """Load a PEFT adapter into `model` (adding its adapters first if it has none); every tensor's
    module and shape is checked before anything is copied."""
    spec, named = read_adapter(path)
    weights_file = Path(path) / WEIGHTS_FILE
    layers = projections(model)
    for name, t in named.items():
        module_name, which = name.rsplit(".", 1)
        layer = layers.get(module_name)
        if layer is None:
            raise CheckpointError(
                f"{weights_file}: adapts {module_name!r}, which this model does not have "
                "(an adapter trained on another base model?)"
            )
        want = adapter_shape(layer, which, spec.rank)
        if tuple(t.shape) != want:
            raise CheckpointError(
                f"{weights_file}: {name} has shape {tuple(t.shape)}, this model's layer needs {want} "
                "(an adapter trained on another base model?)"
            )
    own = spec_of(model)
    if own is None:
        add_adapters(model, spec, seed)
    elif set(adapted(model)) != set(spec.targets) or own.rank != spec.rank:
        raise CheckpointError(
            f"{weights_file}: its adapters (rank {spec.rank}, {len(spec.targets)} layers) differ from this run's "
            f"(rank {own.rank}, {len(adapted(model))} layers)"
        )
    layers = adapted(model)
    with torch.no_grad():
        for name, t in named.items():
            module_name, which = name.rsplit(".", 1)
            getattr(layers[module_name], which).copy_(t)
    return spec


def export_lora(
    model: nn.Module, path: str | os.PathLike, base_model: str, merged: bool, tokenizer=None
) -> Path:
    """--save-hf of a LoRA run: the PEFT adapter directory, or (`merged`) a whole HF checkpoint
    of base + adapter that loads without peft."""
    from miles.lora.adapters import merged_state
    from miles.models.checkpoint import atomic_directory, hf_state_dict, save_model

    if merged:
        return save_model(model, path, tokenizer=tokenizer, state=merged_state(model, hf_state_dict(model)))
    with atomic_directory(path) as tmp:
        save_adapter(model, tmp, base_model=base_model)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def save_sync_adapter(named: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """A LoRA sync payload (`miles.sync.payload`) as a PEFT adapter directory (the SGLang
    backend's disk transport): rank from A's rows, alpha = scale x rank."""
    from miles.lora.serving import SCALE

    scale = float(named[SCALE])
    tensors = {n: t for n, t in named.items() if n != SCALE}
    modules = tuple(sorted({n.rsplit(".", 1)[0] for n in tensors}))
    rank = int(tensors[f"{modules[0]}.lora_A"].shape[0])
    return write_adapter(path, tensors, LoraSpec(rank, scale * rank, targets=modules))


def sync_payload_of(path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """A PEFT adapter directory as the named tensors an engine merges (A, B, `lora.scale`)."""
    from miles.lora.serving import SCALE

    spec, named = read_adapter(path)
    return [*named.items(), (SCALE, torch.tensor(float(torch.tensor(spec.scale))))]
