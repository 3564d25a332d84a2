"""`miles doctor --env`: what the machine offers the remedies `miles doctor` suggests (versions, GPUs and peer
access for CUDA IPC, shared memory for zero-copy on CPU, Ray, low-precision variables, and the
INT4 group sizes a model admits)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PRECISION_VARS = (
    "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
    "OPEN_TRAINING_INT4_FAKE_QAT_FLAG",
    "OPEN_TRAINING_INT4_GROUP_SIZE",
    "MILES_DEBUG",
)


def _gpus() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    n = torch.cuda.device_count()
    peers = {
        f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j
    }
    return {
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(n)],
        "peer_access": peers,  # CUDA IPC between these GPUs (what `nvidia-smi topo -m` shows)
    }


def _shared_memory() -> dict:
    shm = Path("/dev/shm")
    if not shm.exists():
        return {"dev_shm": None}
    usage = shutil.disk_usage(shm)
    return {"dev_shm_total_gb": usage.total / 1e9, "dev_shm_free_gb": usage.free / 1e9}


def _ray() -> dict:
    try:
        import ray
    except ImportError:
        return {"ray": None}
    info: dict = {"ray": ray.__version__}
    if ray.is_initialized():
        info["cluster_resources"] = ray.cluster_resources()
    elif os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            info["cluster_resources"] = ray.cluster_resources()
            ray.shutdown()
        except Exception as e:  # noqa: BLE001 - report, do not fail the report
            info["cluster_error"] = f"{type(e).__name__}: {e}"
    else:
        info["cluster_resources"] = "no cluster reachable (RAY_ADDRESS unset); miles train starts a local one"
    return info


def int4_group_sizes(model: str) -> dict:
    """The input sizes of the projections INT4 quantizes, and the group sizes that divide them all."""
    from miles.models import registry
    from miles.quant.convert import quantized_names
    from miles.quant.int4 import divisors

    policy = registry.model_for(model)
    widths = sorted({policy.get_submodule(n).in_features for n in quantized_names(policy)})
    return {"model": model, "linear_input_sizes": widths, "int4_group_sizes": divisors(widths)}


def kv_cache(model: str | None) -> dict:
    """What an engine's KV cache may hold here (--mem-fraction-static of the memory free now), and
    with a model, how many of its tokens that is."""
    from miles.devices import available_memory, human_bytes
    from miles.rollout.kv_budget import DEFAULT_FRACTION, KVBudget

    free = available_memory("cpu")
    info = {
        "memory_free": human_bytes(free),
        "mem_fraction_static": DEFAULT_FRACTION,
        "budget": human_bytes(DEFAULT_FRACTION * free),
        "cache": "pages taken as requests grow (CPU); allocated whole on a GPU",
    }
    if model:
        from miles.models import registry

        per_token = registry.config_for(model).kv_bytes_per_token()
        budget = KVBudget(DEFAULT_FRACTION, free, per_token)
        info |= {"model": model, "bytes_per_token": per_token, "tokens_in_flight": budget.tokens}
    return info


def environment(model: str | None = None) -> dict:
    import platform

    import torch

    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "gpu": _gpus(),
        "shared_memory": _shared_memory(),
        "ray": _ray(),
        # Ray workers started by miles inherit the driver's environment; miles also resolves
        # NVTE_FP8_BLOCK_SCALING_FP32_SCALES into the run's config, which every worker receives
        "precision_env": {v: os.environ.get(v) for v in PRECISION_VARS},
        "kv_cache": kv_cache(model),
    }
    if model:
        report["model"] = int4_group_sizes(model)
    return report


def format_env(report: dict, indent: int = 0) -> str:
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(format_env(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {value}")
    return "\n".join(lines)
