"""deepnvme: tensors between fast local storage and memory at the speed of the hardware.

Importing this package starts no threads, touches no CUDA state and reads no environment
variables; all of that happens when a handle is first used.
"""

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

with warnings.catch_warnings():
    if importlib.util.find_spec("numpy") is None:
        # torch's import warns "Failed to initialize NumPy" when NumPy is absent; deepnvme
        # never uses NumPy, so on the base install that warning is noise. A NumPy that is
        # installed but broken still warns.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                                category=UserWarning)
    import torch  # noqa: F401  (first imported here, under the filter above)

from ._version import __version__
from .checkpoint import (
    AsyncCheckpointer,
    AsyncSaveHandle,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointMismatchError,
    DistributedSaveError,
    FencedStager,
    LoadResult,
    SnapshotStager,
    async_save,
    clean_temp_files,
    gather_folder,
    load,
    load_into,
    load_safetensors,
    save,
    save_distributed,
    save_safetensors,
    save_safetensors_sharded,
)
from .config import IOConfig, override, resolve_config
from .errors import (
    ConfigError,
    DatasetFormatError,
    DeepNVMeError,
    DeepNVMeIOError,
    OffloadMemoryError,
    RanksTimeoutError,
    ShortTransferError,
    UnsupportedBufferError,
    ValidationError,
    VolumeLayoutError,
)
from .handles import AioHandle, GdsHandle, gds_status
from .io.choice import Choice, auto_choices
from .io.movers import EngineProbe, probe_engines
from .io.volume import Volume, VolumePath
from .memory.pinned import BufferPool, free_cpu_locked_tensor, is_pinned, new_cpu_locked_tensor
from .memory.views import cast_to_byte_tensor

# The training, inference and data halves load on first use (PEP 562): ``import deepnvme``
# for a checkpoint load need not pay for them (about half of the package's import time).
_LAZY = {
    "inference": ("inference", None),
    "TokenDataset": ("data", "TokenDataset"),
    "write_token_dataset": ("data", "write_token_dataset"),
    "DeepSpeedOffloadSettings": ("offload", "DeepSpeedOffloadSettings"),
    "OffloadStats": ("offload", "OffloadStats"),
    "ParameterOffload": ("offload", "ParameterOffload"),
    "from_deepspeed_config": ("offload", "from_deepspeed_config"),
    "offload_parameters": ("offload", "offload_parameters"),
    "NVMeOptimizer": ("optim", "NVMeOptimizer"),
    "SwapBufferError": ("swap", "SwapBufferError"),
    "SwapError": ("swap", "SwapError"),
    "TensorSwapper": ("swap", "TensorSwapper"),
}

if TYPE_CHECKING:
    from . import inference
    from .data import TokenDataset, write_token_dataset
    from .offload import (
        DeepSpeedOffloadSettings,
        OffloadStats,
        ParameterOffload,
        from_deepspeed_config,
        offload_parameters,
    )
    from .optim import NVMeOptimizer
    from .swap import SwapBufferError, SwapError, TensorSwapper


def __getattr__(name: str) -> Any:
    """Import a lazily exported name's subpackage on first use; cache it in the namespace."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'deepnvme' has no attribute {name!r}") from None
    sub = importlib.import_module(f".{module}", __name__)
    value = sub if attr is None else getattr(sub, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

__all__ = [
    "AioHandle",
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "BufferPool",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "Choice",
    "ConfigError",
    "DatasetFormatError",
    "DeepNVMeError",
    "DeepNVMeIOError",
    "DeepSpeedOffloadSettings",
    "DistributedSaveError",
    "EngineProbe",
    "FencedStager",
    "GdsHandle",
    "IOConfig",
    "LoadResult",
    "NVMeOptimizer",
    "OffloadMemoryError",
    "OffloadStats",
    "ParameterOffload",
    "RanksTimeoutError",
    "ShortTransferError",
    "SnapshotStager",
    "SwapBufferError",
    "SwapError",
    "TensorSwapper",
    "TokenDataset",
    "UnsupportedBufferError",
    "ValidationError",
    "Volume",
    "VolumeLayoutError",
    "VolumePath",
    "__version__",
    "async_save",
    "auto_choices",
    "cast_to_byte_tensor",
    "clean_temp_files",
    "free_cpu_locked_tensor",
    "from_deepspeed_config",
    "gather_folder",
    "gds_status",
    "inference",
    "is_pinned",
    "load",
    "load_into",
    "load_safetensors",
    "new_cpu_locked_tensor",
    "offload_parameters",
    "override",
    "probe_engines",
    "resolve_config",
    "save",
    "save_distributed",
    "save_safetensors",
    "save_safetensors_sharded",
    "write_token_dataset",
]
