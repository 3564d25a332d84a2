"""C++ kernels built on first use: the system's compiler, a cache on disk, ctypes to call them.

A source is compiled with `-O3 -march=native -fopenmp` (a few seconds, no torch headers) into
`$MILES_KERNEL_CACHE` (else `~/.cache/miles/kernels`), keyed by the source, the compiler and
the CPU, and loaded with ctypes. Used by the fused decode step (`miles.rollout.steps.fused`)
and the training forward's RMSNorm and RoPE (`miles.models.row_ops`). A leaf module: the standard library
only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("miles")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
NO_COMPILER = "no C++ compiler on PATH (g++, c++ or clang++, or set CXX)"


def compiler() -> str | None:
    """The C++ compiler on PATH: $CXX, else g++, c++ or clang++ (None: none)."""
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_key() -> str:
    """What `-march=native` depends on: the CPU's model and flags, where Linux says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("MILES_KERNEL_CACHE", Path.home() / ".cache" / "miles" / "kernels"))


def build(source: Path, name: str, what: str) -> ctypes.CDLL:
    """`source` compiled (once per source, compiler and CPU) and loaded; `what` names it in the log.
    Raises RuntimeError without a compiler or when the build fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(NO_COMPILER)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), cxx, version, *FLAGS, _cpu_key()]).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run(
                [cxx, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} could not build {source.name}:\n{done.stderr[-2000:]}")
            os.replace(built, target)  # atomic: processes building at once each load a whole file
        log.info("built %s (%s)", what, target)
    return ctypes.CDLL(str(target))
