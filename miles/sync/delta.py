"""Delta weight sync: only what changed since the engine's version moves.

The sender keeps the last version it sent, in the dtype the engine receives (fp32, or bf16 for a
bf16 rollout). Each tensor of a new version goes as the XOR of its bit pattern with the old one,
compressed with zstandard: an unchanged element is a run of zero bytes, which compresses to almost
nothing, and a changed one costs its bytes. A checksum (xxh3-64) of the new tensor goes with it,
so the receiver refuses a delta that does not reproduce the sender's tensor bit for bit.

Versions apply in order: a delta names the version it applies on, and a receiver at any other
version (a late joiner, a restarted engine, one that refused a delta) refuses it; the sender then
sends a full version, which resets the chain. In fp32 nearly every element changes every step (an
Adam update moves all of them by a few ulps); in bf16 most updates round away: that is where a
delta pays (`sync_changed_fraction` measures it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import zstandard

from miles.errors import MilesError
from miles.sync.buckets import checksum_bytes, tensor_bytes

log = logging.getLogger("miles")

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bit pattern


class DeltaRefused(MilesError):
    """A delta that does not apply here: wrong base version, or its result fails the checksum."""


@dataclass(frozen=True)
class TensorDelta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: bytes  # zstd of (new bits XOR base bits); a full tensor: zstd of its bytes
    checksum: int  # xxh3-64 of the new tensor's bytes
    changed: int  # elements whose bits differ from the base's


@dataclass(frozen=True)
class WeightDelta:
    """One version's tensors: `base` None for a full version (resets the chain)."""

    version: int
    base: int | None
    tensors: tuple[TensorDelta, ...]

    @property
    def moved_bytes(self) -> int:
        return sum(len(t.payload) for t in self.tensors)

    @property
    def changed_fraction(self) -> float:
        total = sum(torch.Size(t.shape).numel() for t in self.tensors)
        return sum(t.changed for t in self.tensors) / max(total, 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


class DeltaEncoder:
    """The sender: each `encode` is a delta on the previous version, or a full version first and
    after `reset` (a receiver refused one)."""

    def __init__(self, dtype: torch.dtype | None = None, level: int = 1) -> None:
        self.dtype = dtype  # the engine's receive dtype; None: each tensor's own
        self.base: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.compressor = zstandard.ZstdCompressor(level=level)

    def reset(self) -> None:
        self.base, self.version = {}, None

    def encode(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightDelta:
        named = [(name, t, t.detach().to("cpu", self.dtype or t.dtype).contiguous()) for name, t in named]
        if self.version is not None and any(
            name not in self.base or self.base[name].shape != new.shape for name, _, new in named
        ):
            self.reset()  # a tensor the chain has never seen: start over with a full version
        full = self.version is None
        out = []
        for name, source, new in named:
            old = self.base.get(name)
            if full:
                diff, changed = tensor_bytes(new), new.numel()
            else:
                xor = torch.bitwise_xor(_bits(new), _bits(old))
                diff, changed = tensor_bytes(xor), int(torch.count_nonzero(xor))
            raw = tensor_bytes(new)
            out.append(
                TensorDelta(
                    name, tuple(new.shape), new.dtype, self.compressor.compress(diff.numpy().tobytes()),
                    checksum_bytes(raw), changed,
                )
            )  # fmt: skip
            # kept as sent; a copy only where `new` is the trainer's own tensor (updated in place next)
            self.base[name] = new.clone() if new.data_ptr() == source.data_ptr() else new
        delta = WeightDelta(version, None if full else self.version, tuple(out))
        self.version = version
        return delta


class DeltaDecoder:
    """The receiver's side: the last version it holds (in the receive dtype) and its number."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.decompressor = zstandard.ZstdDecompressor()

    def apply(self, delta: WeightDelta) -> list[tuple[str, torch.Tensor]]:
        """The new version's tensors (for `update_weights`); raises DeltaRefused, leaving this
        decoder unchanged, when the delta is not on this version or does not check out."""
        if delta.base is not None and delta.base != self.version:
            raise DeltaRefused(f"delta on version {delta.base}, but this engine holds version {self.version}")
        new_state = {}
        for t in delta.tensors:
            try:
                raw = torch.frombuffer(bytearray(self.decompressor.decompress(t.payload)), dtype=torch.uint8)
            except zstandard.ZstdError as e:
                raise DeltaRefused(f"{t.name}: the delta does not decompress ({e})") from e
            if raw.numel() != torch.Size(t.shape).numel() * t.dtype.itemsize:
                raise DeltaRefused(f"{t.name}: the delta holds {raw.numel()} bytes, not the tensor's")
            if delta.base is None:
                new = raw.view(t.dtype).view(t.shape)
            else:
                old = self.state.get(t.name)
                if old is None or tuple(old.shape) != t.shape:
                    raise DeltaRefused(f"delta for {t.name}, which this engine does not hold in that shape")
                new = torch.bitwise_xor(_bits(old), raw.view(BITS[old.element_size()]).view(t.shape))
                new = new.view(t.dtype)
            if checksum_bytes(tensor_bytes(new)) != t.checksum:
                raise DeltaRefused(f"{t.name}: the delta does not reproduce the sender's tensor (checksum)")
            new_state[t.name] = new
        self.state.update(new_state)
        self.version = delta.version
        return list(new_state.items())


def deliver(
    version: int, send: Callable[[list[int] | None], tuple[list[int], int]], reset: Callable[[], None]
) -> int:
    """One version by delta, for every transport: `send(only)` encodes and sends it (to the
    engines `only`, or all) and returns (the engines that refused it, bytes moved). Where any
    refused, the chain restarts (`reset`) and a full version goes to them. Returns bytes moved."""
    refused, moved = send(None)
    if not refused:
        return moved
    log.warning("delta sync v%d refused by engine(s) %s; sending a full version", version, refused)
    reset()
    still, full = send(refused)
    if still:
        raise MilesError(f"delta sync: engine(s) {still} refused a full version {version}")
    return moved + full
