"""Checkpoints: save/load both ways with transformers, sharding, and clear errors on bad input."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from miles.errors import CheckpointError
from miles.models import load_model, save_model
from tests.conftest import random_model, tiny_config


def ids_batch():
    return torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))


def test_save_then_transformers_loads_same_logits(arch, tmp_path):
    model = random_model(arch, seed=11)
    save_model(model, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(ids_batch()).logits - model(ids_batch()).logits).abs().max() < 1e-4
    back = load_model(tmp_path / "m").eval()
    with torch.no_grad():
        assert torch.equal(back(ids_batch()).logits, model(ids_batch()).logits)


def test_load_what_transformers_saved(arch, tmp_path):
    cfg = tiny_config(arch).to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(4)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(ids_batch()).logits - ours(ids_batch()).logits).abs().max() < 1e-4


def test_sharded_checkpoint_round_trip(tmp_path):
    model = random_model("qwen3_moe", seed=1)
    save_model(model, tmp_path / "s", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s", dtype=torch.float32).eval()
    back = load_model(tmp_path / "s").eval()
    with torch.no_grad():
        assert torch.equal(back(ids_batch()).logits, model(ids_batch()).logits)
        assert (hf(ids_batch()).logits - model(ids_batch()).logits).abs().max() < 1e-4


def test_save_replaces_existing_checkpoint_whole(tmp_path):
    save_model(random_model("llama", seed=1), tmp_path / "c")
    second = random_model("qwen3", seed=2)
    save_model(second, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp or old dirs left
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "c").eval()(ids_batch()).logits, second(ids_batch()).logits)


# ---- bad input: one clear error naming the file and the tensor or field ----


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "nope")


def test_unsupported_architecture(tmp_path):
    save_model(random_model("llama"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*'gpt2'.*not supported"):
        load_model(tmp_path / "m")


def test_config_missing_field(tmp_path):
    save_model(random_model("llama"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*hidden_size"):
        load_model(tmp_path / "m")


def test_missing_tensor(tmp_path):
    save_model(random_model("qwen3"), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(f)
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, f)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.k_norm\.weight.*missing"
    ):
        load_model(tmp_path / "m")


def test_shape_mismatch(tmp_path):
    save_model(random_model("llama"), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(f)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(state, f)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*up_proj\.weight.*\(95, 64\).*\(96, 64\)"):
        load_model(tmp_path / "m")


def test_missing_shard(tmp_path):
    save_model(random_model("qwen3_moe"), tmp_path / "s", max_shard_bytes=200_000)
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json.*{shard.name}.*missing"):
        load_model(tmp_path / "s")


def test_no_weights_file(tmp_path):
    save_model(random_model("llama"), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path / "m")
