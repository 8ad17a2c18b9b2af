"""Page-locked host memory, buffer pools and the device staging pipeline."""

from ..io.staging import CudaCopier, DeviceCopier, StagingPipeline
from .copy import ParallelCopy, copy_bytes
from .pinned import BufferPool, free_cpu_locked_tensor, is_pinned, locked_bytes, new_cpu_locked_tensor

__all__ = ["BufferPool", "CudaCopier", "DeviceCopier", "ParallelCopy", "StagingPipeline",
           "copy_bytes", "free_cpu_locked_tensor", "is_pinned", "locked_bytes",
           "new_cpu_locked_tensor"]
