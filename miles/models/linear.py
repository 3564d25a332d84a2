"""Every linear layer of a model is built by one factory.

The model asks `factory(name, in_features, out_features, bias)` for each projection, with `name`
its qualified parameter prefix (e.g. ``model.layers.3.mlp.experts.5.up_proj``). Quantization
(FP8, INT4 fake-quant) plugs in here by name pattern, without touching the model file.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch.nn as nn

LinearFactory = Callable[[str, int, int, bool], nn.Module]


def default_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """Plain `nn.Linear` (fp32 on CPU)."""
    return nn.Linear(in_features, out_features, bias=bias)


def pattern_factory(
    rules: Sequence[tuple[str, LinearFactory]], fallback: LinearFactory = default_linear
) -> LinearFactory:
    """A factory choosing by glob pattern on the layer name; the first matching rule wins.

    Example: ``pattern_factory([("*lm_head*", default_linear), ("*", fp8_linear)])``.
    """

    def factory(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        for pattern, make in rules:
            if fnmatch.fnmatch(name, pattern):
                return make(name, in_features, out_features, bias)
        return fallback(name, in_features, out_features, bias)

    return factory
