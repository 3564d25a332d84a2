"""Soak under faults: a Ray run (2 training ranks, 2 engines, reward worker processes) whose
parts are killed every few steps, compared with the same run left alone.

Faults come from `--fault-inject` (miles/faults.py), cycling through the driver killed
mid-rollout / mid-step / mid-sync / mid-checkpoint, an engine killed while it generates, a
training rank killed before its step, and a reward worker killed mid-call. Whenever the driver
dies (SIGKILL) or stops on a dead rank, the soak starts it again with `--load` as a user would.
A second phase runs on `miles serve` processes (`--rollout-backend sglang`) and kills one server
mid-run, restarting it on the same port.

A last phase runs partial rollout (in-process, and async on Ray engines) --repeats times beside
--hogs busy processes: every run must equal the first.

Printed per phase: steps, restarts, faults fired, whether every step's metrics (rewards,
losses, gradient norms, sample counts, weight versions) equal the undisturbed run's, the data
position, and the largest weight difference of the final checkpoints.

    .venv/bin/python benchmarks/soak.py                      # ~30 min on 2 CPU cores
    .venv/bin/python benchmarks/soak.py --steps 12 --every 3 --no-server --repeats 2  # a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "miles" / "assets" / "default_train.yaml"
FAULT_CYCLE = [
    "driver@rollout", "engine@rollout", "reward@rollout", "driver@step", "rank@step", "driver@sync",
    "driver@checkpoint",
]  # fmt: skip
TIMING = ("time", "seconds", "per_s", "mem_", "engine_", "spec_draft_time")


def reward(sample) -> float:
    """The task's exact-match reward, run in reward worker processes (so a fault can kill one)."""
    from miles.rewards.builtin import exact_match

    return exact_match(sample.response, sample.label)


def job(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--config", str(DEFAULT), "--num-rollout", str(steps), "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4", "--eval-size", "16", "--eval-interval", "5",
        "--output-dir", str(out / "run"), "--save", str(out / "ckpt"), "--save-interval", "1",
        "--custom-rm-path", "benchmarks.soak:reward", "--reward-num-workers", "2", "--no-progress", *extra,
    ]  # fmt: skip


def miles_train(args: list[str], on_start=None) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "train", *args], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if on_start is not None:
        on_start()
    _, err = proc.communicate()
    if proc.returncode not in (0, -signal.SIGKILL):
        print("   ", (err.strip().splitlines() or ["(no output)"])[-1][:200], flush=True)
    return proc.returncode


def until_done(args: list[str], out: Path, on_start=None) -> int:
    """Run, and after each death resume from the last checkpoint; returns the restarts."""
    restarts = 0
    while True:
        load = ["--load", str(out / "ckpt")] if (out / "ckpt" / "latest").exists() else []
        code = miles_train(args + load, on_start if restarts == 0 else None)
        if code == 0:
            return restarts
        restarts += 1
        if restarts > 100:
            raise SystemExit("more than 100 restarts: the run does not recover")


def records(out: Path) -> list[dict]:
    from miles.diagnostics.metrics_file import read_metrics

    return [
        {k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in read_metrics(out / "run")
    ]


def final_state(out: Path):
    import torch
    from safetensors.torch import load_file

    latest = (out / "ckpt" / "latest").read_text().strip()
    ckpt = out / "ckpt" / f"iter_{int(latest):07d}"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    return load_file(str(ckpt / "model" / "model.safetensors")), state


def compare(name: str, ref: Path, got: Path, restarts: int, outside_faults: int = 0) -> None:
    a, b = records(ref), records(got)
    same_steps = [r["rollout"] for r in a] == [r["rollout"] for r in b]
    mismatched = sorted(
        {k for x, y in zip(a, b) for k in x if k not in y or abs(float(x[k]) - float(y[k])) > 1e-5 * (1 + abs(float(x[k])))}
    )  # fmt: skip
    (wa, sa), (wb, sb) = final_state(ref), final_state(got)
    weight_diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    fired = []
    if (got / "run" / "faults_fired.jsonl").exists():
        fired = [
            json.loads(x)["fault"] for x in (got / "run" / "faults_fired.jsonl").read_text().splitlines()
        ]
    print(
        f"{name}: {len([r for r in b if r['rollout'] >= 0])} steps, {restarts} restarts, {len(fired) + outside_faults} faults"
    )
    print(f"  steps logged as the undisturbed run: {same_steps}; metrics differing: {mismatched or 'none'}")
    print(f"  data position: {sa.get('data_position')} vs {sb.get('data_position')} (undisturbed vs soaked)")
    print(f"  final weights: max |difference| {weight_diff:.3g}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.cli", "serve", "--model", "tiny", "--port", str(port), "--max-batch-size", "16"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"miles serve on port {port} did not start")


def wait_for_rollout(metrics: Path, rollout: int, timeout: float = 600) -> int:
    """Block until the run has logged `rollout`; returns the last rollout logged when it was seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists():
            logged = [json.loads(x).get("rollout", -1) for x in metrics.read_text().splitlines() if x.strip()]
            if logged and max(logged) >= rollout:
                return max(logged)
        time.sleep(0.05)
    raise SystemExit(f"{metrics}: rollout {rollout} never logged")


def server_phase(tmp: Path, steps: int) -> None:
    """Two `miles serve` processes; the run's second server is killed mid-run and restarted."""
    ports = [free_port(), free_port()]
    servers = [start_server(p) for p in ports]
    flags = ["--rollout-backend", "sglang", "--sglang-url", ",".join(f"http://127.0.0.1:{p}" for p in ports)]
    try:
        ref, got = tmp / "server_ref", tmp / "server_soak"
        until_done(job(ref, steps, *flags), ref)

        killed_at: list[int] = []

        def kill_and_restart():
            killed_at.append(wait_for_rollout(got / "run" / "metrics.jsonl", steps // 2))
            servers[1].kill()
            servers[1].wait()
            time.sleep(2)
            servers[1] = start_server(ports[1])

        killer = threading.Thread(target=kill_and_restart)
        restarts = until_done(job(got, steps, *flags), got, on_start=killer.start)
        killer.join()
        compare(
            f"SGLang-backend servers (one killed after rollout {killed_at[0]}, restarted)",
            ref,
            got,
            restarts,
            1,
        )
    finally:
        for s in servers:
            s.kill()


def under_load(tmp: Path, repeats: int, hogs: int, which: str = "both") -> None:
    """Partial rollout (in-process, and async on Ray engines) run `repeats` times while `hogs`
    busy processes compete for the cores: where a rollout stops must not depend on timing."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    partial = ["--partial-rollout", "--over-sampling-batch-size", "16", "--rollout-temperature", "1.0"]
    modes = {
        "partial rollout, in-process engine": partial,
        "async + partial rollout, 2 Ray engines": [
            *partial,
            "--async-weight-sync",
            "--rollout-num-gpus",
            "2",
        ],
    }
    if which != "both":
        modes = {name: flags for name, flags in modes.items() if ("Ray" in name) == (which == "ray")}
    try:
        for m, (name, flags) in enumerate(modes.items()):
            runs = []
            for i in range(repeats):
                out = tmp / f"load_{m}_{i}"
                until_done(job(out, 4, *flags), out)
                runs.append(records(out))
            same = sum(r == runs[0] for r in runs)
            print(
                f"{name}: {repeats} runs beside {hogs} busy processes, {same} identical to the first",
                flush=True,
            )
    finally:
        for b in busy:
            b.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120, help="rollouts of the Ray run (0: skip)")
    parser.add_argument("--every", type=int, default=3, help="a fault every this many rollouts")
    parser.add_argument("--server-steps", type=int, default=20, help="rollouts of the server phase")
    parser.add_argument("--no-server", action="store_true", help="skip the SGLang-backend phase")
    parser.add_argument(
        "--repeats", type=int, default=10, help="partial-rollout runs under CPU load (0: skip)"
    )
    parser.add_argument("--hogs", type=int, default=2, help="busy processes during those runs")
    parser.add_argument(
        "--repeat-engines", choices=("both", "local", "ray"), default="both", help="which runs to repeat"
    )
    args = parser.parse_args()
    layout = ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]
    faults = []
    for i, rollout in enumerate(range(1, args.steps - 1, args.every)):
        faults += ["--fault-inject", f"{FAULT_CYCLE[i % len(FAULT_CYCLE)]}:{rollout}"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.steps:  # 0: skip the Ray phase
            t0 = time.time()
            until_done(job(tmp / "ref", args.steps, *layout), tmp / "ref")
            print(f"undisturbed Ray run: {time.time() - t0:.0f} s", flush=True)
            t0 = time.time()
            restarts = until_done(job(tmp / "soak", args.steps, *layout, *faults), tmp / "soak")
            print(f"soaked Ray run: {time.time() - t0:.0f} s", flush=True)
            compare(
                "Ray run (driver, engine, rank and reward-worker faults)", tmp / "ref", tmp / "soak", restarts
            )
        if not args.no_server:
            server_phase(tmp, args.server_steps)
        if args.repeats:
            under_load(tmp, args.repeats, args.hogs, args.repeat_engines)


if __name__ == "__main__":
    main()
