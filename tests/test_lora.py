"""LoRA: adapters over a frozen base, PEFT files both ways, adapter-only sync, refusals, a run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from miles.config import load_config
from miles.errors import CheckpointError, ConfigError
from miles.lora.adapters import (
    LoraSpec,
    adapted,
    add_adapters,
    disabled,
    merge_and_unload,
    merged_state,
    spec_of,
)
from miles.lora.peft_files import load_adapter, save_adapter
from miles.models.checkpoint import hf_state_dict, is_adapter_weight, save_model
from miles.models.registry import load as registry_load
from miles.rollout.weights import apply_named_tensors, served_weights
from miles.sync.payload import published_weights
from miles.train.prepare import prepare_train_model
from tests.conftest import random_model, small_run_args

IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 64], [3, 3, 12, 80, 55, 21, 9, 1]])


def trained_adapter(model, seed: int = 0) -> None:
    """Random A and B, as after training (B starts at zero, which would hide a wrong B)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapted(model).values():
            m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=gen) * 0.2)
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_adapter_hook_merge_and_engine_merge_agree(arch):
    model = random_model(arch, seed=3)
    base_logits = model(IDS).logits
    engine = random_model(arch, seed=3)  # the engine's copy: the base, no adapters
    names = add_adapters(model, LoraSpec(rank=4, alpha=8.0), seed=1)
    assert torch.equal(model(IDS).logits, base_logits)  # B = 0: a fresh adapter changes nothing
    if arch == "qwen2_moe":  # experts and the shared expert are adapted, routers are not
        assert any(".experts.3.down_proj" in n for n in names) and any(
            "shared_expert.up_proj" in n for n in names
        )
        assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in names)
    trained_adapter(model)
    hooked = model(IDS).logits
    assert (hooked - base_logits).abs().max() > 1e-2  # the adapter does something
    with disabled(model):
        assert torch.equal(model(IDS).logits, base_logits)
    # the trainer's merged weights give the hooked outputs
    merged = random_model(arch, seed=3)
    merged.load_state_dict(merged_state(model, hf_state_dict(model)))
    assert (merged(IDS).logits - hooked).abs().max() < 1e-4
    # the engine receives the adapters alone, in buckets that split A from B and bring the scale last
    payload = list(published_weights(model).items())
    assert all(is_adapter_weight(n) or n == "lora.scale" for n, _ in payload)
    assert payload[-1][0] == "lora.scale"
    half = len(payload) // 2 + 1
    for bucket in (payload[:half], payload[half:]):
        apply_named_tensors(engine, bucket)
    assert torch.equal(engine(IDS).logits, merged(IDS).logits)  # the same bits as the trainer's merge
    apply_named_tensors(engine, payload)  # a second sync merges onto the base, not onto the last merge
    assert torch.equal(engine(IDS).logits, merged(IDS).logits)
    served = served_weights(engine)
    assert all(torch.equal(served[n], t) for n, t in payload)  # what --check-lora-weight-equal reads back
    plain = merge_and_unload(copy.deepcopy(model))  # PEFT's merge_and_unload: a plain model again
    assert not adapted(plain) and spec_of(plain) is None
    assert torch.equal(plain(IDS).logits, merged(IDS).logits)


def test_peft_loads_our_adapter_and_we_load_peft_s(tmp_path):
    """Our saved adapter on the transformers model through peft gives our logits, and an adapter
    trained by peft loads into miles with its logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = random_model("qwen3", seed=5)
    save_model(model, tmp_path / "base")
    add_adapters(model, LoraSpec(rank=4, alpha=16.0, targets=("q_proj", "v_proj", "down_proj")), seed=2)
    trained_adapter(model, seed=3)
    save_adapter(model, tmp_path / "ours", base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["peft_type"] == "LORA"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "ours").eval()
    with torch.no_grad():
        assert (peft_model(IDS).logits - model(IDS).logits).abs().max() < 1e-4

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = get_peft_model(
        hf, LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj", "up_proj"], use_rslora=True)
    )
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = random_model("qwen3", seed=5)
    spec = load_adapter(ours, tmp_path / "theirs")
    assert spec.rank == 2 and spec.rslora and len(adapted(ours)) == 4  # k_proj and up_proj of 2 layers
    with torch.no_grad():
        assert (theirs.eval()(IDS).logits - ours(IDS).logits).abs().max() < 1e-4


def test_bad_lora_input_is_refused_naming_the_flag_or_file(tmp_path):
    def prepare(*flags):
        return prepare_train_model(random_model("llama", seed=0), load_config(["--lora-rank", "4", *flags]))

    with pytest.raises(ConfigError, match=r"--lora-target-modules: 'qkv_proj' matches no layer.*q_proj"):
        prepare("--lora-target-modules", "q_proj,qkv_proj")
    with pytest.raises(ConfigError, match=r"--lora-rank 64 is larger than layer .*k_proj .*above 32"):
        prepare_train_model(random_model("llama", seed=0), load_config(["--lora-rank", "64"]))
    with pytest.raises(ConfigError, match="--lora-alpha configures LoRA; add --lora-rank"):
        load_config(["--lora-alpha", "8"])
    with pytest.raises(ConfigError, match="--lora-adapter-path .*no such directory"):
        load_config(["--lora-adapter-path", str(tmp_path / "nowhere")])
    # an adapter trained on another base model (wider layers)
    other = random_model("llama", seed=0, hidden_size=96, intermediate_size=128, head_dim=24)
    add_adapters(other, LoraSpec(rank=4, alpha=8.0), seed=0)
    save_adapter(other, tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: .*has shape .*another base model"):
        prepare("--lora-rank", "0", "--lora-adapter-path", str(tmp_path / "other"))
    own = random_model("llama", seed=0)
    add_adapters(own, LoraSpec(rank=4, alpha=8.0), seed=0)
    save_adapter(own, tmp_path / "own")
    with pytest.raises(ConfigError, match="--lora-rank 8 differs from the rank 4 of --lora-adapter-path"):
        prepare_train_model(
            random_model("llama", seed=0),
            load_config(["--lora-rank", "8", "--lora-adapter-path", str(tmp_path / "own")]),
        )
    with pytest.raises(ConfigError, match="--true-on-policy-mode with --lora-rank"):
        load_config(["--lora-rank", "4", "--true-on-policy-mode"])


def test_lora_run_trains_adapters_only_and_resumes_exactly(tmp_path):
    """The default job with LoRA: the base never moves, the optimizer holds the adapters alone,
    the engine serves what the trainer computes, a resumed run equals the straight one, and the
    exports load (PEFT adapter; merged checkpoint equal to base + adapter)."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.models import registry
    from miles.run import train

    flags = [
        "--lora-rank",
        "8",
        "--lr",
        "1e-3",
        "--check-lora-weight-equal",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
    ]
    import shutil

    straight, ckpt = tmp_path / "straight", tmp_path / "ckpt"
    # zero-copy here, buckets in the resumed run: both transports serve the same adapter
    extra = [
        "--save-hf",
        str(tmp_path / "adapter"),
        "--use-zero-copy-sync",
        "--save",
        str(ckpt),
        "--save-interval",
        "1",
    ]
    train(load_config(small_run_args(straight, 3) + flags + extra))
    shutil.rmtree(ckpt / "iter_0000002")  # as if stopped after rollout 1
    (ckpt / "latest").write_text("1")
    resumed = tmp_path / "resumed"
    merged_dir = tmp_path / "merged"
    train(
        load_config(
            small_run_args(resumed, 3) + flags + ["--load", str(ckpt), "--save-hf", str(merged_dir)]
            + ["--lora-merge-on-export"]
        )
    )  # fmt: skip
    a = {r["rollout"]: r for r in read_metrics(straight) if "loss" in r}
    b = {r["rollout"]: r for r in read_metrics(resumed) if "loss" in r}
    assert list(a) == [0, 1, 2] and list(b) == [2]
    for key in ("loss", "reward_mean", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-5, abs=1e-8), key
    for r in a.values():
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-4  # the engine serves base + adapter
        # the reference is the base (adapters off): 0 before the first update, then the policy moves away
        assert (r["kl_loss"] > 0.0) == (r["rollout"] > 0)
    # the exported adapter loads onto a fresh base; the merged export equals that (so the run's base
    # never moved)
    base, tokenizer = registry.load("tiny", seed=0)
    model, _ = registry.load("tiny", seed=0)
    spec = load_adapter(model, tmp_path / "adapter")
    assert spec.rank == 8
    # every attention adapter trained (an expert no token was routed to keeps B = 0)
    assert all(m.lora_B.abs().max() > 0 for n, m in adapted(model).items() if "self_attn" in n)
    merged, _ = registry.load(str(merged_dir))
    with torch.no_grad():
        assert (merged(IDS).logits - model(IDS).logits).abs().max() < 1e-4
        assert (merged(IDS).logits - base(IDS).logits).abs().max() > 1e-4


def test_quantized_base_serves_the_adapter_as_trained_and_sft_trains_adapters(tmp_path):
    """FP8 base (QLoRA-style): the engine keeps the adapter beside its FP8 layers, so rollout and
    training log-probs agree as closely as without LoRA; `miles sft --lora-rank` lowers the loss
    training the adapters alone and saves a PEFT adapter."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from miles.train.sft import SFTConfig, run_sft

    flags = ["--lora-rank", "8", "--lr", "1e-3", "--fp8-recipe", "blockwise"]
    train(load_config(small_run_args(tmp_path / "fp8", 2) + flags))
    trained = [r for r in read_metrics(tmp_path / "fp8") if "loss" in r]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in trained)  # merged and requantized: ~3e-3

    log = tmp_path / "sft.jsonl"
    run_sft(SFTConfig(model="tiny", task="basic_arithmetic", steps=12, batch_size=16, lr=3e-3, eval_size=0,
                      lora_rank=4, save=str(tmp_path / "sft"), log=str(log)))  # fmt: skip
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert sum(losses[-3:]) < sum(losses[:3])
    fresh, _ = registry_load("tiny")
    load_adapter(fresh, tmp_path / "sft")
    assert any(m.lora_B.abs().max() > 0 for m in adapted(fresh).values())
