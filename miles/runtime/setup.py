"""Building a run's data sources and its run directory from the configuration."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from miles.config import to_dict
from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem, PromptStream, file_prompts, task_prompts
from miles.errors import ConfigError


@dataclass
class RunData:
    train: PromptStream
    eval_items: list[PromptItem]
    task_dataset: object | None
    max_prompt_len: int


def build_data(cfg: RunConfig) -> RunData:
    d = cfg.data
    task_dataset = None
    if d.task:
        items, task_dataset = task_prompts(d.task, d.task_size, cfg.train.seed, d.task_config)
        if d.eval_prompt_data:
            eval_items = file_prompts(
                d.eval_prompt_data, d.input_key, d.label_key, d.metadata_key, "--eval-prompt-data"
            )
        elif d.eval_size > 0:  # held out: another seed's problems; training never sees them
            eval_items, _ = task_prompts(d.task, d.eval_size, cfg.train.seed + 10_007, d.task_config)
        else:
            eval_items = []
        held_out = {str(i.prompt) for i in eval_items}
        items = [i for i in items if str(i.prompt) not in held_out]
    elif d.prompt_data:
        items = file_prompts(d.prompt_data, d.input_key, d.label_key, d.metadata_key)
        eval_items = (
            file_prompts(d.eval_prompt_data, d.input_key, d.label_key, d.metadata_key, "--eval-prompt-data")
            if d.eval_prompt_data
            else []
        )
    else:
        raise ConfigError("no prompts: give --task (e.g. basic_arithmetic) or --prompt-data FILE")
    longest = max(len(json.dumps(i.prompt)) for i in items + eval_items)
    # byte length bounds the token count of any tokenizer; chat templates add a little
    return RunData(PromptStream(items, cfg.train.seed), eval_items, task_dataset, longest + 64)


def resolve_device(name: str):
    """`--device` as a torch device: auto means cuda when this process sees a GPU (a Ray actor
    sees the GPU its bundle gave it)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def run_dir_for(cfg: RunConfig) -> Path:
    path = Path(cfg.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path
