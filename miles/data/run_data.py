"""A run's prompts: the training stream, the held-out items and the task (its scorer)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem, PromptStream, file_prompts, task_prompts
from miles.errors import ConfigError


def image_tokens(images: list) -> int:
    """About the image tokens of `images`: one per 28 x 28 pixels (Qwen2-VL's merged block) and
    the two markers around each."""
    from miles.data.images import image_size

    total = 0
    for x in images:
        width, height = image_size(x)
        total += -(-width // 28) * -(-height // 28) + 2
    return total


@dataclass
class RunData:
    train: PromptStream
    eval_items: list[PromptItem]
    task_dataset: object | None
    max_prompt_len: int


def build_data(cfg: RunConfig) -> RunData:
    data_cfg = cfg.data
    task_dataset = None
    if data_cfg.task:
        items, task_dataset = task_prompts(
            data_cfg.task, data_cfg.task_size, cfg.train.seed, data_cfg.task_config
        )
        if data_cfg.eval_prompt_data:
            eval_items = file_prompts(
                data_cfg.eval_prompt_data,
                data_cfg.input_key,
                data_cfg.label_key,
                data_cfg.metadata_key,
                "--eval-prompt-data",
            )
        elif data_cfg.eval_size > 0:  # held out: another seed's problems; training never sees them
            eval_items, _ = task_prompts(
                data_cfg.task, data_cfg.eval_size, cfg.train.seed + 10_007, data_cfg.task_config
            )
        else:
            eval_items = []
        held_out = {str(i.prompt) for i in eval_items}
        # an image task's prompts share their text (the image is the problem): another seed's draws
        items = [i for i in items if i.images or str(i.prompt) not in held_out]
    elif data_cfg.prompt_data:
        items = file_prompts(
            data_cfg.prompt_data, data_cfg.input_key, data_cfg.label_key, data_cfg.metadata_key,
            image_key=data_cfg.multimodal_keys.get("image"),
        )  # fmt: skip
        eval_items = (
            file_prompts(
                data_cfg.eval_prompt_data,
                data_cfg.input_key,
                data_cfg.label_key,
                data_cfg.metadata_key,
                "--eval-prompt-data",
                image_key=data_cfg.multimodal_keys.get("image"),
            )
            if data_cfg.eval_prompt_data
            else []
        )
    else:
        raise ConfigError("no prompts: give --task (e.g. basic_arithmetic) or --prompt-data FILE")
    longest = max(len(json.dumps(i.prompt)) for i in items + eval_items)
    # each image adds its tokens: the largest the processor makes of these images
    longest += max((image_tokens(i.images) for i in items[:64] + eval_items[:64] if i.images), default=0)
    # byte length bounds the token count of any tokenizer; chat templates add a little
    return RunData(PromptStream(items, cfg.train.seed), eval_items, task_dataset, longest + 64)
