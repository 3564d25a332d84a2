"""`option()`: a dataclass field that carries its help text, aliases and availability."""

from __future__ import annotations

import dataclasses
from typing import Any


def option(
    default: Any,
    help: str,
    aliases: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    available: bool | str = True,
) -> Any:
    """A config field. `aliases` are extra flag spellings (slime/miles names); `available` is
    True, or a sentence saying why the feature is not built yet (setting it is then an error)."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "available": available}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


NOT_YET_FP8 = "FP8 training/rollout is not built yet (planned: miles.quant)"
NOT_YET_INT4 = "INT4 QAT is not built yet (planned: miles.quant)"
NOT_YET_SPEC = "speculative rollout with a draft model is not built yet"
NOT_YET_EP = (
    "expert parallelism is not built yet; to fit a large MoE, --data-parallel fsdp shards the experts (with "
    "their gradients and optimizer state) over the training ranks, and --rollout-num-gpus-per-engine splits "
    "every expert over an engine's GPUs"
)
NOT_YET_MA = "multi-agent co-evolution is not built yet"
NOT_YET_MOE = "not built yet for miles' MoE layers"
