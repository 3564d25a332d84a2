"""The weight-update group: the trainer broadcasts weight buckets to every engine process over
`torch.distributed` (gloo on CPU, NCCL on GPU), the way slime feeds disaggregated engines.

The group is a process group of its own (a TCPStore and a gloo/NCCL backend object) beside the
default group a process may already have (training ranks' data parallelism, a tensor-parallel
engine's ranks), so joining it disturbs neither. Rank 0 sends; in each sync it broadcasts the
bucket count, then for every bucket its pickled `BucketMeta` (names, shapes, dtypes, offsets,
checksums) and its bytes. Receivers check every tensor's checksum; a corrupted bucket is not
applied, the receiver keeps receiving (a collective must stay in step) and raises at the end
naming the tensors.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from miles.errors import MilesError
from miles.models.checkpoint import plan_buckets
from miles.sync.buckets import SyncIntegrityError, checksum_bytes, pack_bucket, unpack_bucket
from miles.sync.transports import SyncStats


class WeightGroup:
    """One member of a weight-update group: rank 0 is the sender, ranks 1.. the engine processes."""

    def __init__(
        self, addr: str, port: int, rank: int, world: int, device: torch.device, timeout_s: float = 300.0
    ) -> None:
        """Blocks until all `world` members have joined (rank 0 serves the rendezvous at addr:port)."""
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            self.backend = dist.ProcessGroupNCCL(self.store, rank, world)
        else:
            self.backend = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.world, self.device = rank, world, device

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.backend.broadcast([tensor], opts).wait()

    def _broadcast_bytes(self, blob: bytes | None) -> bytes:
        size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        if blob is not None:
            buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(buf)
        return blob if blob is not None else bytes(buf.cpu().numpy())

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncStats:
        """Rank 0: every tensor, in checksummed buckets of at most `bucket_bytes`."""
        stats, t0 = SyncStats(), time.perf_counter()
        plan = plan_buckets(named, bucket_bytes)
        try:
            self._broadcast_bytes(pickle.dumps(len(plan)))
            for items in plan:
                flat, meta = pack_bucket(items)
                self._broadcast_bytes(pickle.dumps(meta))
                self._broadcast(flat.to(self.device))
                stats.buckets += 1
                stats.tensors += len(items)
                stats.payload_bytes += meta.nbytes
                stats.moved_bytes += meta.nbytes * (self.world - 1)
        except Exception:
            self.close()  # a member died: the others must not wait for buckets that will not come
            raise
        stats.seconds = time.perf_counter() - t0
        return stats

    def send_blob(self, blob: bytes) -> None:
        """Rank 0: one opaque message (a pickled weight delta) to every member."""
        try:
            self._broadcast_bytes(blob)
        except Exception:
            self.close()
            raise

    def receive_blob(self) -> bytes:
        """Ranks 1..: rank 0's `send_blob` message."""
        return self._broadcast_bytes(None)

    def close(self) -> None:
        """Leave the group (its connections close; members still waiting on it get an error)."""
        self.backend = self.store = None

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Ranks 1..: each bucket's tensors (views into the received buffer, valid until the
        next bucket arrives), checksums verified; raises `SyncIntegrityError` at the end if any
        tensor arrived corrupted (those buckets are not yielded)."""
        count = pickle.loads(self._broadcast_bytes(None))
        bad: list[str] = []
        for _ in range(count):
            meta = pickle.loads(self._broadcast_bytes(None))
            flat = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            host = flat.cpu()
            wrong = [
                m.name
                for m in meta.tensors
                if checksum_bytes(host[m.offset : m.offset + m.nbytes]) != m.checksum
            ]
            if wrong:
                bad.extend(wrong)
                continue
            yield unpack_bucket(flat, meta, verify=False)
        if bad:
            raise SyncIntegrityError(
                f"weight-update group: {len(bad)} tensor(s) arrived corrupted on rank {self.rank}: {bad[:5]}"
            )


class GroupSender:
    """Rank 0 of a weight-update group, for a class with a `device`: joining makes a new group
    (the previous one is left first), leaving closes it so receivers still waiting get an error."""

    weight_group: WeightGroup | None = None
    device: torch.device

    def join_weight_group(self, addr: str, port: int, world: int) -> None:
        self.weight_group = None
        self.weight_group = WeightGroup(addr, port, 0, world, self.device)

    def leave_weight_group(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()


def free_port() -> int:
    """A free TCP port below the OS's ephemeral range. A port the OS handed out (bind to 0) is free
    only until the socket closes: Ray's workers also bind to 0 and can get it before the rank that
    should listen there (seen: a training rank's store failed with EADDRINUSE). Ports outside the
    ephemeral range are never handed out that way."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = random.sample(range(20000, max(low, 20001)), k=min(200, max(low - 20000, 1)))
    for port in [*candidates, 0]:  # 0: let the OS choose, if all else is taken
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise MilesError("no free TCP port for a torch.distributed rendezvous")
