"""FastPersist checkpoints: torch.save/safetensors-compatible files at the storage's speed."""

from .async_save import AsyncCheckpointer, AsyncSaveHandle, async_save
from .atomic import clean_temp_files, wait_for_releases
from .distributed import DistributedSaveError, save_distributed
from .format import CheckpointFormatError
from .load import load
from .safetensors import load_safetensors, save_safetensors
from .save import save

__all__ = [
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "CheckpointFormatError",
    "DistributedSaveError",
    "async_save",
    "clean_temp_files",
    "load",
    "load_safetensors",
    "save",
    "save_distributed",
    "save_safetensors",
    "wait_for_releases",
]
