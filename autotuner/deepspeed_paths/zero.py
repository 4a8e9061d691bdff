"""`deepspeed.zero`: the names scripts reach as `deepspeed.zero.X` (autotuner.runtime.zero's)."""

from autotuner.deepspeed_paths.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
from autotuner.deepspeed_paths.runtime.zero.partition_parameters import (  # noqa: F401
    GatheredParameters, Init, ZeroParamStatus)

__all__ = ["GatheredParameters", "Init", "OffloadDeviceEnum", "OffloadStateTypeEnum", "ZeroParamStatus"]
