"""miles.config: the typed run configuration, CLI and YAML loading, aliases and validation."""

from miles.config.loader import build_train_parser, describe, load_config, make_config, to_dict
from miles.config.schema import RunConfig

__all__ = ["RunConfig", "build_train_parser", "describe", "load_config", "make_config", "to_dict"]
