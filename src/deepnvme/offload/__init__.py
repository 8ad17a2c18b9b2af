"""Parameter and gradient offload for training: models larger than memory, on NVMe."""

from .parameters import OffloadStats, ParameterOffload, offload_parameters

__all__ = ["OffloadStats", "ParameterOffload", "offload_parameters"]
