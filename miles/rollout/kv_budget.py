"""How much KV cache an engine may hold: `--mem-fraction-static` of the memory free when it
starts (its weights already loaded), in tokens.

The engine admits a request only while the tokens reserved by those in flight (each its prompt
plus `max_new_tokens`, at most the context) fit the budget; the rest wait in its queue. A
configuration that can never run is refused before anything is allocated, with the figures: a
single request of the full context larger than the budget, or (on a GPU, whose cache is
allocated whole) all the slots' cache. SGLang's flag of the same name counts the weights in the
share; here the weights are already loaded when the share is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.devices import available_memory, human_bytes
from miles.errors import MilesError

DEFAULT_FRACTION = 0.5


@dataclass(frozen=True)
class KVBudget:
    fraction: float  # --mem-fraction-static
    free_bytes: int  # memory free when the engine started
    bytes_per_token: int  # keys and values of one position, every layer

    @property
    def bytes(self) -> int:
        return int(self.fraction * self.free_bytes)

    @property
    def tokens(self) -> int:
        return self.bytes // self.bytes_per_token

    def describe(self) -> str:
        return (
            f"up to {self.tokens} tokens in flight ({human_bytes(self.bytes)}: --mem-fraction-static {self.fraction:g} of "
            f"{human_bytes(self.free_bytes)} free, {self.bytes_per_token / 1024:.1f} KiB a token)"
        )


def plan_budget(
    bytes_per_token: int, slots: int, max_seq_len: int, device: torch.device, fraction: float, whole: bool
) -> KVBudget:
    """The engine's budget; refuses a configuration that cannot run. `whole`: the cache is
    allocated at once (a GPU) rather than as it fills."""
    budget = KVBudget(fraction, available_memory(device), bytes_per_token)
    one = max_seq_len * bytes_per_token
    if one > budget.bytes:
        raise MilesError(
            f"one request of the engine's context ({max_seq_len} tokens) needs {human_bytes(one)} of KV cache, and the engine "
            f"may use {human_bytes(budget.bytes)} (--mem-fraction-static {fraction:g} of the {human_bytes(budget.free_bytes)} free): "
            "lower the context (miles serve --max-seq-len, or a run's --rollout-max-response-len) or raise "
            "--mem-fraction-static"
        )
    if whole and slots * one > budget.bytes:
        raise MilesError(
            f"{slots} slots x {max_seq_len} tokens need {human_bytes(slots * one)} of KV cache on {device}, allocated at once, "
            f"and the engine may use {human_bytes(budget.bytes)} (--mem-fraction-static {fraction:g} of "
            f"{human_bytes(budget.free_bytes)} free): lower --rollout-max-batch-size to {max(1, budget.bytes // one)} or the "
            "context, or raise --mem-fraction-static"
        )
    return budget


def weight_bytes(config) -> int:
    """The bytes a model of `config` holds in fp32, counted without allocating it."""
    from miles.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() * 4 for p in model.parameters())


def check_weights_fit(spec: str, config, flag: str = "--model") -> None:
    """Refuse, before loading, a model whose fp32 weights exceed the memory free now."""
    need, free = weight_bytes(config), available_memory("cpu")
    if need > free:
        raise MilesError(
            f"{flag} {spec}: its weights need {human_bytes(need)} in fp32 and {human_bytes(free)} is free; free memory, or use a "
            "smaller model"
        )
