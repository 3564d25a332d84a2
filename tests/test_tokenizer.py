"""The built-in byte tokenizer is a standard tokenizer.json that transformers loads back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from miles.models import byte_tokenizer

TOK = byte_tokenizer()
SPECIAL = list(TOK.get_added_vocab())  # chat and control tokens: one id each, not one per byte


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40).filter(lambda t: not any(s in t for s in SPECIAL)))
def test_byte_tokenizer_round_trips_any_text(text):
    ids = TOK(text).input_ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert TOK.decode(ids) == text


def test_saved_tokenizer_loads_with_transformers(tmp_path):
    TOK.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "12+30=42\n<|im_end|>"
    assert again(text).input_ids == TOK(text).input_ids
    assert again.eos_token == "<|im_end|>" and again.pad_token == "<|pad|>"
    prompt = again.apply_chat_template(
        [{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    assert len(TOK) == 260
