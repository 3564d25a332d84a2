"""miles.sync: moving weights from the trainer to rollout engines (buckets, transports, checks)."""

from miles.sync.buckets import SyncIntegrityError, pack_bucket, plan_buckets, unpack_bucket

__all__ = ["SyncIntegrityError", "pack_bucket", "plan_buckets", "unpack_bucket"]
