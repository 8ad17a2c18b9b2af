"""Parameter and gradient offload for training: models larger than memory, on NVMe."""

from ._device_offload import DeviceOffloadStats, offload_parameters
from .deepspeed_config import (
    DeepSpeedOffloadSettings,
    OptimizerOffloadSettings,
    ParamOffloadSettings,
    from_deepspeed_config,
)
from .parameters import (
    OffloadStats,
    ParameterOffload,
    register_external_parameter,
)

__all__ = ["DeepSpeedOffloadSettings", "DeviceOffloadStats", "OffloadStats", "OptimizerOffloadSettings",
           "ParamOffloadSettings", "ParameterOffload", "from_deepspeed_config", "offload_parameters",
           "register_external_parameter"]
