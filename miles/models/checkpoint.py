"""Hugging Face checkpoints in and out: config.json + (sharded) safetensors, and GGUF import.

Loading checks every tensor (present, right shape) before the model is returned, and each
problem raises one `CheckpointError` naming the file and the tensor or field. Saving writes to a
temporary directory and renames it into place, so a checkpoint is never half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.errors import CheckpointError
from miles.models.config import ModelConfig
from miles.models.linear import LinearFactory, default_linear
from miles.models.transformer import Transformer, rope_inv_freq

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model derives itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

ADAPTER_SUFFIXES = ("lora_A", "lora_B")  # LoRA's A and B matrices: a model's weights beside its base


def is_adapter_weight(name: str) -> bool:
    """Whether `name` is a LoRA adapter's weight (checkpoints and syncs of the base leave it out)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split tensors, in order, into groups of at most `bucket_bytes` bytes each (checkpoint
    shards, weight-sync buckets)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    return [b for b in buckets if b]


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path}: expected a directory holding config.json (or a .gguf file)"
        )
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(
            f"{config_file}: missing; a Hugging Face checkpoint directory needs config.json"
        )
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from e
    return ModelConfig.from_hf_dict(hf, source=str(config_file))


def tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (single file or index)."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(f"{index}: names shard {shard.name}, which is missing from {path}")
        return files
    single = path / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; nothing to load the weights from")
    try:
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as e:  # a truncated or corrupt header
        raise CheckpointError(f"{single}: cannot be read as safetensors ({e})") from e


def read_tensors(
    path: Path, files: dict[str, Path], names: Iterable[str], tp: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """The named tensors; with `tp` = (rank, world), only that tensor-parallel rank's part of
    each split tensor is read from disk (see `miles.models.tensor_parallel`)."""
    from miles.models.tensor_parallel import shard, split_dim

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        try:
            with safe_open(file, "pt") as f:
                for name in file_names:
                    if tp is None:
                        out[name] = f.get_tensor(name)
                    elif (dim := split_dim(name)) is None:
                        out[name] = shard(name, f.get_tensor(name), *tp)  # whole, or a zeroed row bias
                    else:
                        part = f.get_slice(name)
                        n = part.get_shape()[dim] // tp[1]
                        rows = slice(tp[0] * n, (tp[0] + 1) * n)
                        out[name] = part[rows] if dim == 0 else part[:, rows]
        except Exception as e:  # a truncated or corrupt file
            raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from e
    return out


def load_state_dict_into(model: Transformer, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `model` after checking names and shapes; nothing is copied on error."""
    expected = {k: v for k, v in model.state_dict().items() if not is_adapter_weight(k)}  # the base
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing{more}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{source}: tensor {unexpected[0]!r} is not part of a {model.config.model_type} model with "
            f"this config.json ({len(unexpected)} unexpected tensor(s))"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    make_linear: LinearFactory = default_linear,
    tp: tuple[int, int] | None = None,
) -> Transformer:
    """Load a Hugging Face checkpoint directory into a miles `Transformer` (a `.gguf` file:
    `miles.models.gguf`, through `registry.load`).
    With `tp` = (rank, world): that rank's tensor-parallel part, reading only its slices of the
    split tensors (the whole model is never built; forward needs the engine's process group)."""
    from miles.models.tensor_parallel import shard_model

    path = Path(path)
    config = read_config(path)
    files = tensor_files(path)
    state = read_tensors(path, files, files.keys(), tp=tp)
    if tp is None:
        model = Transformer(config, make_linear)
    else:
        with torch.device("meta"):  # shapes only, then storage for this rank's part alone
            model = shard_model(Transformer(config, make_linear), *tp)
        model.to_empty(device="cpu")  # gives every parameter its own storage: tie lm_head again
        model.inv_freq = rope_inv_freq(model.config)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    source = str(path / INDEX_FILE) if (path / INDEX_FILE).exists() else str(path / SINGLE_FILE)
    load_state_dict_into(model, state, source)
    return model.to(device=device, dtype=dtype)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and alone in its storage: a parameter that is a view of a larger tensor is
    copied out, since safetensors refuses shared storage."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def hf_state_dict(
    model: Transformer, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by Hugging Face name (tied lm_head and LoRA adapters left
    out: the base); from `state` when given (e.g. the whole weights an FSDP model gathered), else
    from the model."""
    state = model.state_dict() if state is None else state
    state = {k: _own_storage(v) for k, v in state.items() if not is_adapter_weight(k)}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside `path` (named .tmp_<name>.*) to fill; when the block ends
    without error it replaces `path` whole, else it is removed. A reader never sees half of it;
    a killed writer leaves only a .tmp_ directory (`miles.runtime.train_state.clear_stale`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".tmp_{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer=None,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a Hugging Face checkpoint directory atomically, in safetensors shards of at most
    `max_shard_bytes` (split as weight-sync buckets are: `plan_buckets`), of the
    model's weights or of `state` (HF-named, e.g. a LoRA model merged)."""
    path = Path(path)
    with atomic_directory(path) as tmp:
        state = hf_state_dict(model) if state is None else state
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        shards = [dict(items) for items in plan_buckets(state.items(), max_shard_bytes)] or [{}]
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_FILE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / shard_name, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, shard_name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return path
