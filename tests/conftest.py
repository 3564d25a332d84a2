"""Shared test helpers: tiny random configs of every supported architecture."""

from __future__ import annotations

import os

import pytest
import torch

from miles.models import ModelConfig, Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, torch.get_num_threads()))

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"]


def tiny_config(model_type: str, **overrides) -> ModelConfig:
    kw = dict(
        model_type=model_type,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
    )
    if model_type.endswith("moe"):
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        kw["norm_topk_prob"] = model_type == "qwen3_moe"
    if model_type == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = 48
    kw.update(overrides)
    return ModelConfig(**kw)


def random_model(model_type: str, seed: int = 0, **overrides) -> Transformer:
    """A model with random weights, norms and biases perturbed so that none is trivially 1 or 0."""
    model = Transformer(tiny_config(model_type, **overrides)).init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for one test module; 4 logical CPUs, since on CPU a bundle is a process, not
    a core (2 ranks + 2 engines fit a 2-core machine)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def free_port() -> int:
    """A free TCP port on this host, for a test's torch.distributed rendezvous."""
    from miles.runtime.placement import free_port as pick

    return pick()
