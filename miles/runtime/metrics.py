"""A run's directory: made at start, with the resolved configuration in it (its metrics are
`miles.diagnostics.metrics_file.MetricsLogger`'s)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import yaml

from miles.config import to_dict
from miles.config.schema import RunConfig
from miles.errors import ConfigError

log = logging.getLogger("miles")


def run_dir_for(cfg: RunConfig) -> Path:
    path = Path(cfg.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--output-dir {path}: cannot be created ({e.strerror or e}); give a directory you can write"
        ) from e
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path
