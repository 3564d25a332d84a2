"""Engines that fit the machine: the shipped SmolLM2 served, generated from and trained with
every default, and the peak resident memory of each process.

- `miles serve --model <the shipped .gguf>` (64 slots, the model's 8192-token context): seconds
  until GET /health answers, then 64 concurrent requests of 256 tokens each (ignore_eos), the
  server's resident memory sampled throughout (its peak, VmHWM, at the end) and its tokens/s;
- `miles generate --model <.gguf>` with 256 new tokens: peak resident memory;
- `miles train --model smollm2 --num-rollout 2` (the default job's task and settings on
  SmolLM2): peak resident memory.

The worst case a cache sized for every slot at the full context would take is printed beside
the figures (64 x 8192 tokens x 46 KiB a token for SmolLM2).

    .venv/bin/python benchmarks/engine_memory.py                 # the table of docs/rollout.md
    .venv/bin/python benchmarks/engine_memory.py --only serve
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.models import registry
from miles.models.gguf import smollm2_gguf_path

ROOT = Path(__file__).resolve().parent.parent
MILES = [sys.executable, "-m", "miles.cli"]


def status_kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1))


def peak_of(cmd: list[str], timeout: float) -> tuple[float, float, str]:
    """Run `cmd` to its end: (peak resident GiB, seconds, the last of its output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    peak = 0
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            peak = max(peak, status_kb(proc.pid, "VmHWM"))
        except (OSError, AttributeError):
            pass
        time.sleep(0.2)
        if time.perf_counter() - start > timeout:
            proc.kill()
            raise SystemExit(f"{cmd}: still running after {timeout} s")
    reader.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(out)[-2000:]}")
    return peak / 2**20, time.perf_counter() - start, "".join(out)[-300:]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def serve(gguf: str, port: int, requests: int, tokens: int) -> dict:
    cmd = [*MILES, "serve", "--model", gguf, "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"miles serve exited: {proc.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.5)
            if time.perf_counter() - start > 300:
                raise SystemExit("miles serve: no /health answer in 300 s")
        ready = time.perf_counter() - start
        idle = status_kb(proc.pid, "VmRSS")
        body = {
            "text": "Write a long story about a robot who learns to paint.",
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.7},
        }

        def one(i: int) -> int:
            data = json.dumps({**body, "sampling_params": {**body["sampling_params"], "seed": i}}).encode()
            request = urllib.request.Request(url + "/generate", data, {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(request, timeout=1800).read())
            return int(answer["meta_info"]["completion_tokens"])

        rss = [idle]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                rss.append(status_kb(proc.pid, "VmRSS"))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            generated = sum(pool.map(one, range(requests)))
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        return {
            "health_seconds": ready,
            "idle_gib": idle / 2**20,
            "peak_gib": status_kb(proc.pid, "VmHWM") / 2**20,
            "max_sampled_gib": max(rss) / 2**20,
            "tokens": generated,
            "tokens_per_s": generated / seconds,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("serve", "generate", "train"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=30177)
    args = parser.parse_args()
    gguf = str(smollm2_gguf_path())
    policy, _ = registry.load("smollm2")
    worst = 64 * policy.config.max_position_embeddings * policy.kv_bytes_per_token()
    del policy
    print(f"SmolLM2 ({gguf}): a cache for 64 slots x 8192 tokens would take {worst / 2**30:.1f} GiB")
    print("| command | peak resident | other |\n|---|---|---|")
    if args.only in (None, "serve"):
        r = serve(gguf, args.port, args.requests, args.tokens)
        print(
            f"| `miles serve --model <gguf>` | {r['peak_gib']:.2f} GiB | /health after {r['health_seconds']:.1f} s; "
            f"{args.requests} concurrent requests x {args.tokens} tokens: {r['tokens']} tokens, "
            f"{r['tokens_per_s']:.0f} tok/s; idle {r['idle_gib']:.2f} GiB |"
        )
    if args.only in (None, "generate"):
        cmd = [*MILES, "generate", "--model", gguf, "--prompt", "Once upon a time", "--max-new-tokens", "256"]
        peak, seconds, _ = peak_of(cmd, 600)
        print(f"| `miles generate --model <gguf> --max-new-tokens 256` | {peak:.2f} GiB | {seconds:.0f} s |")
    if args.only in (None, "train"):
        out = Path("runs/engine_memory_train")
        cmd = [
            *MILES,
            "train",
            "--model",
            "smollm2",
            "--num-rollout",
            "2",
            "--output-dir",
            str(out),
            "--no-progress",
        ]
        peak, seconds, _ = peak_of(cmd, 1800)
        print(f"| `miles train --model smollm2 --num-rollout 2` | {peak:.2f} GiB | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
