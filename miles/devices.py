"""Devices and memory: `--device` names as torch devices, and each process's memory figures.

A leaf module (torch and the standard library only), so the engine, the trainer, the Ray actors
and the run measure memory the same way.

Per-step peak memory of a process: host RSS (and CUDA allocated/reserved on a GPU).

The OS keeps a process's peak resident set (VmHWM); Linux lets a process reset its own
(/proc/self/clear_refs, "5"), so reading then resetting it once per step gives each step's own
peak. Elsewhere the lifetime peak (`ru_maxrss`) is reported instead. Growth of this number across
steps is the host-side leak that `watch nvidia-smi` would show on a GPU.
"""

from __future__ import annotations

import ctypes
import re
import resource
import sys
from contextlib import contextmanager
from pathlib import Path

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _peak_rss() -> int:
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


_carried: dict[str, int] = {}  # peaks read inside the current step (by `measure_peak` windows)
_open: list[dict[str, int]] = []  # the running maxima of the `measure_peak` windows now open


def _read_and_reset(device) -> dict[str, int]:
    out = {"peak_rss": _peak_rss()}
    try:
        _CLEAR.write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pass  # not Linux, or not permitted: the lifetime peak stays
    import torch

    if device is not None and torch.device(device).type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _fold(into: dict[str, int], peaks: dict[str, int]) -> None:
    for key, value in peaks.items():
        into[key] = max(into.get(key, 0), value)


def _read_fold_reset(device) -> dict[str, int]:
    """Read and reset the peaks, folding them into the step's and every open window's maxima
    (a reset must not hide a peak from an enclosing measurement)."""
    peaks = _read_and_reset(device)
    _fold(_carried, peaks)
    for window in _open:
        _fold(window, peaks)
    return peaks


def step_peak_memory(device=None) -> dict[str, int]:
    """This process's peak memory since the last call (bytes); then starts the next window."""
    _read_fold_reset(device)
    out = dict(_carried)
    _carried.clear()
    return out


def _glibc():
    """glibc through ctypes, or None (another C library: musl, macOS)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it, so the RSS a window starts from would
    still hold an earlier, larger allocation's pages)."""
    if libc := _glibc():
        libc.malloc_trim(0)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)


def reuse_freed_memory() -> None:
    """Keep freed host memory in the heap for the next allocation (a training or engine process).

    glibc serves each allocation above 32 MiB with a fresh mmap and unmaps it on free, so every
    step's large tensors (a vocabulary-sized gradient, a micro-batch's activations) fault their
    pages in again, zeroed by the kernel: on SmolLM2 about a tenth of a training step, as system
    time. Served from the heap instead, they reuse the pages a step freed, as the CUDA caching
    allocator does on a GPU. The resident size then stays at the run's peak between steps
    (`measure_peak` still trims before it measures)."""
    if libc := _glibc():
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, -1)  # read as size_t: never


@contextmanager
def setup_objects_frozen():
    """Inside the block, Python's cycle collector skips every object alive at its start.

    A run's set-up leaves ~0.5 million long-lived objects (imported modules, the task's prompts,
    the model); each full collection walks them all (~0.25 s on 2 cores, every ~20 steps of the
    default job, as a stall in whichever phase it lands). Collected once, then frozen
    (`gc.freeze`), they are never walked again; unfrozen on exit, so a process that runs several
    jobs (tests, notebooks) still frees what each leaves in cycles."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


_libc = None


@contextmanager
def measure_peak(device=None, trim: bool = True):
    """The peak memory of the work inside the block: yields a dict filled on exit (`peak_rss`,
    and `cuda_max_allocated` on a GPU). Windows nest; the step's own peak (`step_peak_memory`)
    still counts what they saw. `trim`: first hand freed heap back to the OS, so an earlier,
    larger allocation does not count (the block then pays page faults for what it takes again)."""
    _read_fold_reset(device)
    if trim:
        _trim()
    _read_and_reset(device)  # the window starts from the trimmed resident size
    window: dict[str, int] = {}
    _open.append(window)
    try:
        yield window
    finally:
        _read_fold_reset(device)
        _open[:] = [w for w in _open if w is not window]  # by identity: equal dicts are other windows


def memory_metrics(role: str, per_process: list[dict[str, int]]) -> dict[str, float]:
    """`mem_<role>_<what>_gb`: the largest over the role's processes (ranks, engines)."""
    keys = {k for p in per_process for k in p}
    return {f"mem_{role}_{k}_gb": max(p.get(k, 0) for p in per_process) / 1e9 for k in sorted(keys)}


def _local(t):
    """A tensor's own bytes in this process (an FSDP DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def weight_memory(model) -> dict[str, int]:
    """Bytes of a model's weights and buffers by dtype (`weights_float32`, `weights_uint8`, ...):
    where a quantized engine's memory goes."""
    out: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        key = "weights_" + str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + _nbytes(t)
    return out


def training_memory(model, optimizer) -> dict[str, int]:
    """Bytes a trainer holds for its policy: weights, gradients and optimizer state."""
    params = list(model.parameters())
    return {
        "weights": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _nbytes(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel")
        ),
    }


def describe_bytes(report: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in report.items() if v)


def resolve_device(name: str):
    """`--device` as a torch device: auto means cuda when this process sees a GPU (a Ray actor
    sees the GPU its bundle gave it)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def available_memory(device) -> int:
    """Bytes a new allocation on `device` can take now: the GPU's free memory, or on the host
    what the kernel reports it can give without swapping (MemAvailable)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) * 1024
    except (OSError, AttributeError):  # not Linux: the physical memory, as the best figure there is
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human_bytes(n: float) -> str:
    """4.20 GiB, 35.0 MiB, 12.0 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def yield_to_trainer(whole_process: bool = False) -> None:
    """Fully-async on CPU cores shared with training: rollout threads run at a lower OS priority,
    so the trainer (the critical path of an overlapped step) keeps its core and the engines use
    what it leaves. With equal priority the scheduler splits the cores evenly and the trainer
    slows by about as much as the overlap saves. `whole_process`: every thread of this process
    (an engine actor); else the calling thread (Linux priorities are per thread, and threads it
    starts inherit it)."""
    import os
    import threading

    tids = (
        [int(t) for t in os.listdir("/proc/self/task")]
        if whole_process and os.path.isdir("/proc/self/task")
        else []
    )
    for tid in tids or [threading.get_native_id()]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)  # the lowest: Ray starts its workers at 15
        except (PermissionError, ProcessLookupError):  # a thread that ended meanwhile; a locked-down host
            pass
