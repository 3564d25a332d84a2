"""Shared test helpers: tiny random configs of every supported architecture."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch: OpenMP reads it once, subprocesses inherit it
    # Each worker gets its share of the cores: two workers of two busy-waiting OpenMP threads
    # each on 2 cores run every torch op about twice as slowly as one thread each.
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

import torch  # noqa: E402

from miles.data.sample import Sample
from miles.models import ModelConfig, Transformer
from miles.sync.group import GroupSender
from miles.sync.object_store import put_buckets
from miles.train.batch import forward_logprobs, pack_samples

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = ROOT / "miles" / "assets" / "default_train.yaml"
# metrics that differ between identical runs: these, and every mem_* and engine_* (see comparable)
TIMING = {"rollout_time", "train_time", "step_time", "sync_seconds"}

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, int(os.environ.get("OMP_NUM_THREADS", "2")), torch.get_num_threads()))

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


RAY_CPUS = 6  # logical: on CPU a bundle is a process, not a core (two agents x (2 ranks + 1 engine))


@pytest.fixture
def ray_cluster():
    """The session's local Ray, started on first use and kept: a Ray start costs seconds, and its
    idle workers (torch already imported) serve the next test's actors. A module that needs a
    cluster of its own shuts this one down; the next test using this fixture starts it again."""
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < RAY_CPUS:
        ray.shutdown()  # a run started a smaller one (ensure_ray)
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield


# Modules whose tests start Ray actors. Under pytest-xdist (`make test`: -n 2 --dist loadscope)
# their tests go to the workers one by one, first: they are the longest, and they wait on process
# start-ups more than they compute, so two overlap well on 2 cores (each worker's tests share its
# local cluster, `ray_cluster`). Every other module goes whole to one worker, so its module
# fixtures start once.
RAY_MODULES = {
    "test_ray_train",
    "test_multinode",
    "test_ray_rollout",
    "test_multiagent_ray",
    "test_placement",
}


def module_of(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


def pytest_collection_modifyitems(config, items) -> None:
    """The Ray modules' tests first, then the other modules, those with the most tests first
    (the order the workers take them in)."""
    modules = {id(item): module_of(item.nodeid) for item in items}
    sizes = Counter(modules.values())
    items.sort(key=lambda item: (modules[id(item)] not in RAY_MODULES, -sizes[modules[id(item)]]))


def pytest_xdist_make_scheduler(config, log):
    """A Ray module's test is a unit of work on its own, any other module is one unit, handed to
    the workers in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "loadscope":
        return None

    class RayTestsApartModulesWhole(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # our order, not by test count

        def _split_scope(self, nodeid: str) -> str:
            return nodeid if module_of(nodeid) in RAY_MODULES else module_of(nodeid)

    return RayTestsApartModulesWhole(config, log)


@pytest.fixture(scope="session", autouse=True)
def _ray_stopped_at_exit():
    yield
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


def free_port() -> int:
    """A free TCP port on this host, for a test's torch.distributed rendezvous."""
    from miles.runtime.placement import free_port as pick

    return pick()


def small_run_args(out: Path, num_rollout: int) -> list[str]:
    return [
        "--config", str(DEFAULT_YAML), "--num-rollout", str(num_rollout), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--eval-size", "8", "--eval-interval", "2", "--micro-batch-size", "8",
        "--output-dir", str(out), "--no-progress",
    ]  # fmt: skip


@pytest.fixture(scope="session")
def local_run(tmp_path_factory):
    """`local_run(steps, *flags)`: the metrics of the one-process run of `small_run_args(steps)`
    plus `flags`, trained once per session: the reference every distributed layout is compared
    with. Under pytest-xdist the workers share it (a directory beside their temp dirs, claimed
    by a file lock): the first to ask trains it, the others read it."""
    import hashlib

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's, above each worker's own
    done: dict[tuple, list[dict]] = {}

    def get(steps: int, *flags: str) -> list[dict]:
        key = (steps, *flags)
        if key not in done:
            from miles.config import load_config
            from miles.diagnostics.metrics_file import read_metrics
            from miles.run import train

            out = shared / f"local_run_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
            with FileLock(str(out) + ".lock"):
                if not (out / "trained").exists():
                    train(load_config(small_run_args(out, steps) + list(flags)))
                    (out / "trained").touch()
            done[key] = read_metrics(out)
        return copy.deepcopy(done[key])

    return get


def comparable(records: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING and not k.startswith(("mem_", "engine_"))}
        for r in records
    ]


def record_trained(monkeypatch) -> list[tuple[int, list]]:
    """(rollout id, samples) of every training step of the runs that follow, as the learner got them."""
    from miles.runtime.learner import Learner

    trained: list[tuple[int, list]] = []
    real = Learner.train

    def spy(self, groups, rollout_id):
        trained.append((rollout_id, [s for g in groups for s in g]))
        return real(self, groups, rollout_id)

    monkeypatch.setattr(Learner, "train", spy)
    return trained


def check_async_run(out: Path, flags: list[str], monkeypatch) -> list[dict]:
    """A 5-step async run: every step trains, no sample is dropped, staleness is 0 or 1 and 1
    occurs (the overlap is real); returns the metrics."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train
    from miles.runtime import feed

    seen = []
    real = feed.drop_stale

    def spy(groups, trainer_version, bound):
        kept, dropped = real(groups, trainer_version, bound)
        seen.extend(s.metadata["staleness"] for g in groups for s in g)
        return kept, dropped

    monkeypatch.setattr(feed, "drop_stale", spy)
    train(load_config(small_run_args(out, 5) + flags))
    records = read_metrics(out)
    assert [r["rollout"] for r in records] == [-1, 0, 1, 2, 3, 4]
    assert all("pg_loss" in r and r["stale_dropped"] == 0 for r in records if r["rollout"] >= 0)
    assert set(seen) <= {0, 1} and 1 in seen  # one step off-policy, never more
    return records


SAME_RUN_KEYS = (
    "reward_mean",
    "eval_accuracy",
    "pg_loss",
    "kl_loss",
    "grad_norm",
    "train_rollout_logprob_abs_diff",
)


def assert_same_run(reference: list[dict], other: list[dict], rel: float = 1e-4) -> None:
    """Two runs' metrics: the same rollouts, and every shared loss/reward key equal within `rel`."""
    assert [r["rollout"] for r in other] == [r["rollout"] for r in reference]
    for a, b in zip(reference, other):
        for key in SAME_RUN_KEYS:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), (a["rollout"], key)


class DriverWeightSource(GroupSender):
    """Test-side sender: The weight-update group's sender for a model in this process (a script or notebook that
    drives a `RolloutManager` itself); `miles train`'s `RayTrainer` offers the same methods for
    its rank 0."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy, self.device = policy, next(policy.parameters()).device

    def weight_group_address(self) -> tuple[str, int]:
        from miles.runtime.placement import free_address

        return free_address()

    def broadcast_weights(self, bucket_bytes: int):
        from miles.models.checkpoint import hf_state_dict

        return self.weight_group.send(hf_state_dict(self.policy).items(), bucket_bytes)

    def publish(self, bucket_bytes: int) -> list:
        from miles.models.checkpoint import hf_state_dict

        return put_buckets(hf_state_dict(self.policy).items(), bucket_bytes)


def response_logprobs(
    model: Transformer, samples: Sequence[Sample], temperature: float = 1.0, replay_routing: bool = False
) -> list[list[float]]:
    """Each sample's response-token log-probabilities from one plain forward: the oracle the
    engine's reported log-probs are compared with."""
    batch = pack_samples(samples, replay_routing)
    with torch.no_grad():
        logp = forward_logprobs(model, batch, temperature, full_logits=True).logprobs
    out = []
    for b, s in enumerate(samples):
        p = s.prompt_length
        out.append(logp[b, p - 1 : len(s.tokens) - 1].tolist())
    return out


@torch.no_grad()
def greedy(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None
) -> list[int]:
    """Prefill the prompt, then decode one token at a time; returns the new token ids."""
    stop = set(stop_ids or [])
    cache = model.new_cache(1, len(prompt_ids) + max_new_tokens)
    ids = torch.tensor([prompt_ids])
    positions = torch.arange(len(prompt_ids))[None]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids, positions=positions, cache=cache).logits[:, -1]
        token = int(logits.argmax(-1))
        out.append(token)
        if token in stop:
            break
        ids, positions = torch.tensor([[token]]), positions[:, -1:] + 1
    return out


def start_server(seed: int = 0, port: int = 0, model: str = "tiny") -> tuple[subprocess.Popen, str]:
    """A `miles serve` process of `model` (port 0: any free one); (the process, its URL)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--model", model, "--port", str(port), "--rollout-seed", str(seed),
         "--max-batch-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    for line in proc.stdout:
        if m := re.search(r"on (http://\S+)", line):
            return proc, m.group(1)
    raise RuntimeError(f"miles serve did not start (exit {proc.wait()})")
