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


def test_a_process_that_reads_no_text_never_imports_transformers():
    """Training ranks and engine actors load the model alone (`registry.model_for`): the
    built-in model's ids are the byte tokenizer's without building it, and no process that only
    computes pays the second transformers takes to import."""
    import subprocess
    import sys

    from miles.models import registry
    from miles.models.tokenizer import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

    assert (len(TOK), TOK.eos_token_id, TOK.pad_token_id) == (BYTE_VOCAB_SIZE, BYTE_EOS_ID, BYTE_PAD_ID)
    config = registry.model_for("tiny-random").config
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (
        len(TOK),
        TOK.eos_token_id,
        TOK.pad_token_id,
    )
    code = (
        "import sys; from miles.models import registry; import miles.runtime.ray_train, miles.runtime.ray_rollout; "
        "[registry.model_for(m) for m in ('tiny', 'tiny-random')]; print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
