"""FastPersist checkpoints: torch.save/safetensors-compatible files at the storage's speed."""

from ..errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointMismatchError,
    DistributedSaveError,
)
from ..io.durable import clean_temp_files, wait_for_releases
from ._placed import gather_folder
from ._sharded import save_safetensors_sharded
from ._staging import FencedStager, SnapshotStager, Stager
from .async_saver import AsyncCheckpointer, AsyncSaveHandle, async_save
from .distributed import save_distributed
from .inplace import LoadResult, load_into
from .loader import load
from .manager import CheckpointManager, SaveStats
from .safetensors import load_safetensors, save_safetensors
from .saver import save

__all__ = [
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DistributedSaveError",
    "FencedStager",
    "LoadResult",
    "SaveStats",
    "SnapshotStager",
    "Stager",
    "async_save",
    "clean_temp_files",
    "gather_folder",
    "load",
    "load_into",
    "load_safetensors",
    "save",
    "save_distributed",
    "save_safetensors",
    "save_safetensors_sharded",
    "wait_for_releases",
]
