"""Weight-sync throughput: each transport next to the memcpy bound, measured in one run.

    .venv/bin/python benchmarks/weight_sync.py                 # 10 MB .. 2 GB
    .venv/bin/python benchmarks/weight_sync.py --sizes-mb 10 100 --no-ray

A "model" is 64 fp32 tensors in Hugging Face naming; the receiver copies every tensor into its
own preallocated weights (what the engine's update_weights does). Transports:
- memcpy: one copy of the whole model (the bound);
- one-at-a-time: a copy per tensor handed over alone (in process), and over Ray's object store
  one ray.put/ray.get per tensor (the OpenRLHF-style baseline);
- bucketed: 512 MiB buckets, checksummed (and without the checksum), in process and over Ray;
- zero-copy: shared-memory handles (a few hundred bytes per tensor), the receiver maps the memory;
- to another process (a Ray actor copying into its own weights, as an engine does), checksummed:
  Ray object store (`put_buckets`, what `--sync-transport object-store` does) and the
  weight-update group's gloo broadcast (`--sync-transport broadcast`).

`--delta`: what `--delta-sync` moves instead. SmolLM2-135M takes real AdamW steps at the
quickstart's learning rate (1e-5, next-token loss on the model's own text) and each version is
encoded against the last (`miles.sync.delta`), with the weights sent in fp32 and in bf16 (what a
bf16 rollout receives) and as an FP8 engine holds them (e4m3 codes with block scales): the changed fraction, the bytes moved against the full size, and the
encode/decode seconds.

    .venv/bin/python benchmarks/weight_sync.py --delta [--delta-steps 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from miles.models.checkpoint import plan_buckets
from miles.sync.buckets import pack_bucket, unpack_bucket
from miles.sync.transports import BucketBuffer, send_bucketed, send_one_at_a_time, send_shared, share

BUCKET = 512 * 1024**2


class Sink:
    """The receiving end: copies each tensor into its own weights."""

    def __init__(self, named):
        self.weights = {n: torch.empty_like(t) for n, t in named}

    def update_weights(self, items, version=None):
        for name, t in items:
            self.weights[name].copy_(t)


def model_of(total_mb: int) -> list[tuple[str, torch.Tensor]]:
    per = total_mb * 1024**2 // 4 // 64
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(per)) for i in range(64)]


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ray_transports(named, repeats):
    import ray

    from miles.sync.object_store import from_object_store

    def one_at_a_time():
        sink = {}
        for name, t in named:
            sink[name] = ray.get(ray.put(t))

    def bucketed():
        for items in plan_buckets(named, BUCKET):
            flat, meta = pack_bucket(items, checksums=False)
            unpack_bucket(
                from_object_store(ray.get(ray.put(flat.numpy()))), meta, verify=False
            )  # as RolloutManager

    return {"ray one-at-a-time": best(one_at_a_time, repeats), "ray bucketed": best(bucketed, repeats)}


def to_actor_transports(named, repeats):
    """Driver -> one engine-like actor in another process, checksummed, both ways the Ray engines use."""
    import ray

    from miles.runtime.placement import free_address
    from miles.sync.group import WeightGroup
    from miles.sync.object_store import put_buckets

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, sizes):  # (name, shape) of each tensor
            self.sink = Sink([(n, torch.empty(shape)) for n, shape in sizes])

        def from_store(self, buckets):
            from miles.sync.object_store import from_object_store

            for meta, ref in buckets:
                self.sink.update_weights(unpack_bucket(from_object_store(ray.get(ref)), meta))

        def join(self, addr, port):
            self.group = WeightGroup(addr, port, 1, 2, torch.device("cpu"))

        def from_group(self):
            for items in self.group.receive():
                self.sink.update_weights(items)

    actor = Receiver.remote([(n, tuple(t.shape)) for n, t in named])
    addr, port = free_address()
    joined = actor.join.remote(addr, port)
    group = WeightGroup(addr, port, 0, 2, torch.device("cpu"))
    ray.get(joined)

    def store():
        ray.get(actor.from_store.remote(put_buckets(named, BUCKET)))

    def broadcast():
        done = actor.from_group.remote()
        group.send(named, BUCKET)
        ray.get(done)

    out = {"actor via store": best(store, repeats), "actor via group": best(broadcast, repeats)}
    ray.kill(actor)
    return out


def measure(mb: int, repeats: int, ray_too: bool) -> None:
    named = model_of(mb)
    nbytes = sum(t.numel() * 4 for _, t in named)
    sink, staging = Sink(named), BucketBuffer()
    src_flat, dst_flat = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    results = {
        "memcpy": best(lambda: dst_flat.copy_(src_flat), repeats),
        "one-at-a-time": best(lambda: send_one_at_a_time(named, sink, None), repeats),
        "bucketed+checksum": best(lambda: send_bucketed(named, sink, None, BUCKET, True, staging), repeats),
        "bucketed": best(lambda: send_bucketed(named, sink, None, BUCKET, False, staging), repeats),
    }
    share(named)
    results["zero-copy shm"] = best(lambda: send_shared(named, sink, None), repeats)
    if ray_too:
        results.update(ray_transports(named, repeats))
        results.update(to_actor_transports(named, repeats))
    line = "  ".join(f"{k} {nbytes / v / 1e9:6.2f}" for k, v in results.items())
    base = results.get("ray one-at-a-time", results["one-at-a-time"])
    print(
        f"{mb:>5} MB  {line}  | bucketed/baseline {base / results['bucketed']:.1f}x, "
        f"zero-copy/baseline {base / results['zero-copy shm']:.1f}x, memcpy/bucketed {results['bucketed'] / results['memcpy']:.1f}x",
        flush=True,
    )


def fp8_weights(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What an FP8 rollout engine holds: each matrix as e4m3 codes with a scale per 128x128 block
    (miles' blockwise recipe), vectors (norms) in bf16."""
    from miles.quant.fp8 import FP8Recipe, quantize

    out = []
    for name, t in named:
        if t.dim() == 2:
            codes, scale = quantize(t, FP8Recipe())
            out += [(name, codes), (name + ".scale", scale)]
        else:
            out.append((name, t.to(torch.bfloat16)))
    return out


def measure_delta(steps: int, lr: float = 1e-5) -> None:
    from miles.models import registry
    from miles.models.checkpoint import hf_state_dict
    from miles.sync.delta import DeltaDecoder, DeltaEncoder

    model, tokenizer = registry.load("smollm2")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = torch.tensor([tokenizer(text).input_ids] * 4)
    sides = {dtype: (DeltaEncoder(dtype), DeltaDecoder()) for dtype in (torch.float32, torch.bfloat16)}
    sides["fp8"] = (DeltaEncoder(), DeltaDecoder())  # what an FP8 engine holds: codes + block scales
    print(f"SmolLM2-135M, AdamW lr {lr}: each version against the last")
    print("| step | dtype | changed elements | moved / full size | encode s | decode s |")
    print("|---|---|---|---|---|---|")
    for step in range(steps + 1):
        named = list(hf_state_dict(model).items())
        for dtype, (encoder, decoder) in sides.items():
            sent = fp8_weights(named) if dtype == "fp8" else named
            itemsize = {"fp8": None}.get(dtype, getattr(dtype, "itemsize", None))
            full = sum(t.numel() * (itemsize or t.element_size()) for _, t in sent)
            t0 = time.perf_counter()
            delta = encoder.encode(sent, step)
            t1 = time.perf_counter()
            decoder.apply(delta)
            t2 = time.perf_counter()
            kind = "full" if delta.base is None else "delta"
            print(
                f"| {step} ({kind}) | {str(dtype).removeprefix('torch.')} | {delta.changed_fraction:.1%} | "
                f"{delta.moved_bytes / 1e6:.0f} MB / {full / 1e6:.0f} MB ({delta.moved_bytes / full:.1%}) | "
                f"{t1 - t0:.2f} | {t2 - t1:.2f} |",
                flush=True,
            )
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 500, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray object-store transports")
    parser.add_argument("--delta", action="store_true", help="only the delta-sync measurement")
    parser.add_argument("--delta-steps", type=int, default=4)
    args = parser.parse_args()
    if args.delta:
        return measure_delta(args.delta_steps)
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=3 * 1024**3)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; GB/s = model bytes / seconds (best of {args.repeats})"
    )
    for mb in args.sizes_mb:
        measure(mb, args.repeats, ray_too=not args.no_ray)


if __name__ == "__main__":
    main()
