"""miles.data: the `Sample`, prompt datasets and batch assembly."""

from miles.data.sample import Sample, Status

__all__ = ["Sample", "Status"]
