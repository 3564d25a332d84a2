"""miles.sync: moving weights from the trainer to rollout engines (buckets, transports, checks)."""

from miles.models.checkpoint import plan_buckets
from miles.sync.buckets import SyncIntegrityError, pack_bucket, unpack_bucket

__all__ = ["SyncIntegrityError", "pack_bucket", "plan_buckets", "unpack_bucket"]
