"""Peer frameworks and engines for the benchmarks, installed on first use into a cache folder
(`$MILES_PEERS`, default ~/.cache/miles/peers: `pip install --target`, a folder per peer), never
into the project's requirements."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

PEERS = Path(os.environ.get("MILES_PEERS", Path.home() / ".cache" / "miles" / "peers"))


def peer(
    module: str,
    packages: list[str],
    folder: str | None = None,
    deps: bool = False,
    drop: tuple[str, ...] = (),
):
    """`module` imported from its folder of the peers' cache (`folder`, default the module's
    name), where `packages` are installed first if it is missing (`deps`: with everything they
    require, pinned versions included, in that folder only; `drop`: installed packages moved out
    to a `<folder>_disabled` sibling, ones that break imports beside it); None, with the reason
    printed, when it cannot be had."""
    target = PEERS / (folder or module)
    sys.path.insert(0, str(target))
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    print(f"installing {' '.join(packages)} into {target} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", *([] if deps else ["--no-deps"]), "--target", str(target),
         *packages],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        print(
            f"{packages[0]}: cannot be installed here: {proc.stderr.strip().splitlines()[-1:]}",
            file=sys.stderr,
        )
        return None
    # the folder did not exist at the first import: forget the finder cached for it as absent
    sys.path_importer_cache.pop(str(target), None)
    importlib.invalidate_caches()
    disabled = target.with_name(target.name + "_disabled")
    for name in drop:
        for path in target.glob(f"{name}*"):
            disabled.mkdir(parents=True, exist_ok=True)
            path.rename(disabled / path.name)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        print(f"{packages[0]}: installed but does not import: {e}", file=sys.stderr)
        return None
