"""miles.sync: moving weights from the trainer to rollout engines (buckets, transports, checks)."""

from miles.sync.buckets import SyncIntegrityError, pack, plan_buckets, unpack

__all__ = ["SyncIntegrityError", "pack", "plan_buckets", "unpack"]
