"""Page-locked host memory, buffer pools, parallel copies and byte views (the device staging
pipeline, which runs over the engine, lives in :mod:`deepnvme.io.staging`)."""

from .copy import ParallelCopy, copy_bytes
from .pinned import BufferPool, free_cpu_locked_tensor, is_pinned, locked_bytes, new_cpu_locked_tensor

__all__ = ["BufferPool", "ParallelCopy", "copy_bytes", "free_cpu_locked_tensor", "is_pinned",
           "locked_bytes", "new_cpu_locked_tensor"]
