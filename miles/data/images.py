"""Prompts with images: the processor call that makes a model's inputs, and the embedded
vision task.

One call per prompt makes both halves of the input (the contract the peers' blind-model bugs
broke): the text's `<image>` placeholders expanded into one image token per merged patch block
(between vision start/end markers), and the pixel tensors those tokens stand for. The sample
carries the pixels (`Sample.multimodal_train_inputs`) through rollout, training and checkpoints.
A checkpoint that ships a Hugging Face processor (`preprocessor_config.json`) is called as it
is; otherwise Hugging Face's Qwen2-VL image processor makes the pixels and the placeholders are
expanded here, as `Qwen2VLProcessor` does.

`--task shapes`: an image of a few coloured squares on a 4 x 4 grid and the question "How many
squares?". The count (1 to 4) is drawn uniformly, so a model that cannot see
scores about 1 in 4.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import torch

from miles.data.prompts import PromptItem
from miles.errors import ConfigError, MilesError

PLACEHOLDER = "<image>"
VISION_MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
CELL = 14  # one patch: a square fills one cell of the 4 x 4 grid
COLOURS = [(220, 40, 40), (40, 180, 60), (40, 80, 220), (230, 200, 30), (200, 60, 200)]


class VisionProcessor:
    """Text + images -> (token ids with the images' tokens expanded, pixel inputs), in one call."""

    def __init__(
        self, tokenizer, spatial_merge_size: int = 2, image_processor=None, keep_images: bool = False
    ) -> None:
        """`keep_images`: also return the images as base64 PNG (`image_data`), for rollout on
        servers that run their own processor (--rollout-backend sglang); encoded only then."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer, self.merge, self.keep_images = tokenizer, spatial_merge_size, keep_images
        self.images = image_processor or Qwen2VLImageProcessorPil(merge_size=spatial_merge_size)
        self.start, self.pad, self.end = VISION_MARKERS

    def __call__(
        self, prompt: str | list[dict], images: list, chat: bool
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        from miles.models.tokenizer import encode_prompt

        loaded = [load_image(x) for x in images]
        out = self.images(images=loaded, return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = iter((grid.prod(-1) // self.merge**2).tolist())
        text = prompt if isinstance(prompt, str) else None
        messages = prompt if isinstance(prompt, list) else None
        found = (text or "".join(m["content"] for m in messages)).count(PLACEHOLDER)
        if found != len(loaded):
            raise MilesError(
                f"the prompt has {found} {PLACEHOLDER} placeholder(s) for {len(loaded)} image(s); put one "
                f"{PLACEHOLDER} where each image goes"
            )

        def expand(s: str) -> str:
            parts = s.split(PLACEHOLDER)
            return parts[0] + "".join(self.start + self.pad * next(counts) + self.end + p for p in parts[1:])

        prompt = (
            expand(text) if text is not None else [{**m, "content": expand(m["content"])} for m in messages]
        )
        ids = encode_prompt(self.tokenizer, prompt, chat)
        pixels = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        if self.keep_images:  # the images themselves, for servers that run their own processor
            pixels["image_data"] = [png(x) for x in loaded]
        return ids, pixels

    def pixels(self, image_data: list) -> dict[str, torch.Tensor]:
        """The pixel inputs of images given as SGLang's image_data (base64 PNG, or paths)."""
        out = self.images(images=[load_image(decode_image_data(x)) for x in image_data], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def png(image) -> str:
    """An image as base64 PNG (what SGLang's image_data takes)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # too long for a file name: base64
        return False


def decode_image_data(x: str):
    """An image_data entry: base64 (optionally a data: URL) or a path."""
    import base64
    import binascii

    if isinstance(x, str) and not _is_file(x):
        try:
            return base64.b64decode(x.split(",", 1)[-1], validate=True)
        except (binascii.Error, ValueError) as e:
            raise MilesError(f"image_data: neither a file nor base64 ({str(x)[:40]}...)") from e
    return x


def join_images(*parts: dict | None) -> dict | None:
    """One conversation's pixel inputs from its turns' (in the order their image tokens come)."""
    from miles.models.vision import batch_images

    pixel_values, grid = batch_images(parts)
    if pixel_values is None:
        return None
    joined = {"pixel_values": pixel_values, "image_grid_thw": grid}
    if any("image_data" in p for p in parts if p is not None):
        joined["image_data"] = [x for p in parts if p is not None for x in p.get("image_data", [])]
    return joined


def image_size(x) -> tuple[int, int]:
    """(width, height) of an image, a path or bytes, read from the header (nothing decoded)."""
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.size
    if isinstance(x, dict) and "bytes" in x:
        x = x["bytes"]
    if isinstance(x, (bytes, bytearray)):
        import io

        x = io.BytesIO(x)
    elif not Path(str(x)).exists():
        return load_image(x).size  # the same error load_image gives
    with Image.open(x) as image:
        return image.size


def load_image(x):
    """A PIL image from an image, a path, or encoded bytes."""
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if isinstance(x, (bytes, bytearray)):
        import io

        return Image.open(io.BytesIO(x)).convert("RGB")
    if isinstance(x, dict) and "bytes" in x:  # Parquet / datasets image columns
        return load_image(x["bytes"])
    path = Path(str(x))
    if not path.exists():
        raise ConfigError(f"image {str(x)[:200]!r}: no such file (give a path, bytes, or an image)")
    return Image.open(path).convert("RGB")


def blank_images(images: list) -> list:
    """White images of the same sizes (--debug-blank-images)."""
    from PIL import Image

    return [Image.new("RGB", load_image(x).size, (255, 255, 255)) for x in images]


def processor_for(model: str, keep_images: bool = False) -> VisionProcessor:
    """The processor of `--model`, which must be a vision-language model."""
    processor = vision_processor(model, keep_images)
    if processor is None:
        raise ConfigError(
            f"--model {model}: prompts with images need a vision-language model (e.g. tiny-vlm)"
        )
    return processor


@functools.lru_cache(maxsize=4)
def vision_processor(model: str, keep_images: bool = False) -> VisionProcessor | None:
    """The processor of `--model`; None for a text-only model (`keep_images`: `VisionProcessor`)."""
    from miles.models import registry

    config = registry.config_for(model)
    if not config.is_vision_language:
        return None
    tokenizer, path = registry.tokenizer_for(model), registry.model_path(model)
    image_processor = None
    if path is not None and (Path(path) / "preprocessor_config.json").exists():
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(str(path))
    return VisionProcessor(tokenizer, config.vision_config.spatial_merge_size, image_processor, keep_images)


def shapes_image(count: int, rng: random.Random):
    """A 56 x 56 image (4 x 4 patches: 4 image tokens) with `count` squares of random colours in distinct cells of a 4 x 4 grid."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (4 * CELL, 4 * CELL), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(16), count):
        x, y, pad = (cell % 4) * CELL, (cell // 4) * CELL, rng.randint(1, 3)
        draw.rectangle([x + pad, y + pad, x + CELL - 1 - pad, y + CELL - 1 - pad], fill=rng.choice(COLOURS))
    return image


def shapes_items(size: int, seed: int, config: dict[str, Any]) -> list[PromptItem]:
    """`size` counting problems: an image of 1..`max_count` squares (task_config max_count, 4)."""
    top = int(config.get("max_count", 4))
    if not 1 <= top <= 16:
        raise ConfigError(f"--task shapes: task_config max_count {top} must be between 1 and 16")
    rng = random.Random(seed)
    items = []
    for _ in range(size):
        count = rng.randint(1, top)
        question = f"{PLACEHOLDER}How many squares?"
        items.append(PromptItem(question, str(count), images=[shapes_image(count, rng)]))
    return items


VISION_TASKS = {"shapes": shapes_items}
