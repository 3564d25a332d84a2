"""Tokenizers: Hugging Face's for real models, and a byte-level one for the built-in model.

The built-in tokenizer is an ordinary `tokenizer.json` (a BPE with no merges over the 256
byte symbols, plus chat special tokens), so a miles checkpoint loads with
`transformers.AutoTokenizer` like any other.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from miles.errors import CheckpointError

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# the byte tokenizer's ids, known without building it (the built-in model's config needs them)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
BYTE_EOS_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")
BYTE_PAD_ID = 256 + SPECIAL_TOKENS.index("<|pad|>")


VISION_SPECIAL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]  # Qwen2-VL's names
BYTE_VISION_IDS = {tok: BYTE_VOCAB_SIZE + i for i, tok in enumerate(VISION_SPECIAL_TOKENS)}


def byte_tokenizer(vision: bool = False):
    """A 260-token byte-level tokenizer (256 bytes + 4 specials) with a ChatML template; `vision`:
    with the three image markers after them (263 tokens: the built-in vision-language model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    specials = SPECIAL_TOKENS + (VISION_SPECIAL_TOKENS if vision else [])
    for tok in specials:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint directory or a `.gguf` file (offline)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        if path.suffix == ".gguf":
            with contextlib.redirect_stderr(io.StringIO()):
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(
            f"{path}: no usable tokenizer (tokenizer.json / tokenizer_config.json): {e}"
        ) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_prompt(tokenizer, prompt, chat: bool) -> list[int]:
    """Token ids of a prompt: a chat (list of messages) or, with `chat`, text as a user turn
    through the chat template (with the generation prompt); else the plain text. One helper
    for the rollout, `miles generate` and `miles sft`."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    return tokenizer(str(prompt)).input_ids
