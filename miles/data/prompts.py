"""Prompt sources: JSONL / Parquet files and reasoning-gym task generators.

Each yields `PromptItem`s (prompt, label, metadata); the loop turns each into a group of
`n_samples_per_prompt` samples. A source has a position so a resumed run continues exactly
where it stopped, with the same order.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import ConfigError

DEFAULT_JOB = Path(__file__).resolve().parent.parent / "assets" / "default_train.yaml"


@dataclass
class PromptItem:
    prompt: str | list[dict[str, str]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list | None = None  # images (or paths, bytes) for the prompt's <image> placeholders


def read_records(path: str | Path, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise ConfigError(f"{flag} {path}: not a readable Parquet file ({e})") from e
    records = []
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(
                    f"{flag} {path}, line {lineno}: not UTF-8 text; save the file as UTF-8 JSONL"
                ) from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} {path}, line {lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict):
                raise ConfigError(f"{flag} {path}, line {lineno}: expected a JSON object per line")
            records.append(record)
    return records


def file_prompts(
    path: str | Path,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    flag: str = "--prompt-data",
    image_key: str | None = None,
) -> list[PromptItem]:
    """The prompts of a JSONL/Parquet file; `image_key` (--multimodal-keys' "image"): the field
    holding each prompt's images (paths are read relative to the file)."""
    records = read_records(path, flag)
    if not records:
        raise ConfigError(f"{flag} {path}: the file has no records")
    items = []
    for i, record in enumerate(records):
        if input_key not in record:
            keys = sorted(record)
            raise ConfigError(
                f"{flag} {path}, record {i}: no key {input_key!r} (--input-key); its keys are {keys}"
            )
        prompt = record[input_key]
        is_chat = isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
        if not (isinstance(prompt, str) and prompt.strip()) and not is_chat:
            raise ConfigError(
                f"{flag} {path}, record {i}: {input_key!r} (--input-key) is {prompt!r}; a prompt is a non-empty "
                "string or a list of chat messages ({'role': ..., 'content': ...})"
            )
        if label_key and label_key not in record:
            raise ConfigError(
                f"{flag} {path}, record {i}: no key {label_key!r} (--label-key); its keys are {sorted(record)}"
            )
        meta = record.get(metadata_key) if metadata_key else None
        if meta is not None and not isinstance(meta, dict):
            raise ConfigError(
                f"{flag} {path}, record {i}: {metadata_key!r} (--metadata-key) must be an object"
            )
        images = None
        if image_key:
            images = record.get(image_key)
            images = [images] if images is not None and not isinstance(images, list) else images
            base = Path(path).parent
            images = [
                base / x if isinstance(x, str) and not Path(x).is_absolute() else x for x in images or []
            ]
        label = record.get(label_key) if label_key else None
        items.append(PromptItem(record[input_key], label, dict(meta or {}), images or None))
    return items


def task_prompts(task: str, size: int, seed: int, config: dict[str, Any]) -> tuple[list[PromptItem], Any]:
    """`size` problems of a reasoning-gym task, and the dataset object (its scorer); or of an
    embedded vision task (`miles.data.images`: no dataset object, the reward scores it)."""
    from reasoning_gym.factory import DATASETS

    from miles.data.images import VISION_TASKS

    if task in VISION_TASKS:
        return VISION_TASKS[task](size, seed, config), None
    if task not in DATASETS:
        names = sorted(DATASETS)
        close = [n for n in names if task.lower() in n or n in task.lower()]
        close += [n for n in difflib.get_close_matches(task, names, n=5, cutoff=0.4) if n not in close]
        hint = f"close names: {close[:5]}" if close else f"it has {len(names)} tasks, e.g. {names[:3]}"
        raise ConfigError(f"--task {task!r} is not a reasoning-gym task; {hint}")
    try:
        dataset, entries = _generate(task, size, seed, json.dumps(config, sort_keys=True))
    except KeyError as e:
        raise ConfigError(f"--task {task!r} is not a reasoning-gym task ({e})") from e
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"--task {task}: bad task_config {config} ({e})") from e
    items = [PromptItem(e["question"], e["answer"], {"rg_entry": e}) for e in entries]
    return items, dataset


@functools.lru_cache(maxsize=8)
def _generate(task: str, size: int, seed: int, config_json: str) -> tuple[Any, tuple[dict, ...]]:
    """The dataset and its entries, kept per process: generating the default 20,000 problems
    takes about a second, and runs in one process (a notebook, a sweep) ask for the same ones."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config_json))
    return dataset, tuple(dataset)


class PromptStream:
    """An endless, reshuffled-per-epoch walk over items; `position` resumes it exactly."""

    def __init__(self, items: list[PromptItem], seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ConfigError("the prompt dataset is empty")
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self.position = 0
        self._epoch, self._cached_order = -1, []

    def _order(self, epoch: int) -> list[int]:
        """The permutation of one epoch (computed once per epoch, not per item)."""
        if epoch != self._epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._epoch, self._cached_order = epoch, order
        return self._cached_order

    def take(self, n: int) -> list[PromptItem]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, len(self.items))
            out.append(self.items[self._order(epoch)[offset]])
            self.position += 1
        return out


@functools.cache
def default_job_task_config() -> dict[str, Any]:
    """The embedded default job's task settings (basic_arithmetic, 1-2 digits, + and -): what other
    commands build their problems from when none are given."""
    import yaml

    return yaml.safe_load(DEFAULT_JOB.read_text())["data"]["task_config"]
