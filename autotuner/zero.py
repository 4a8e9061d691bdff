"""`deepspeed.zero`: the names scripts reach as `deepspeed.zero.X` (autotuner.runtime.zero's)."""

from autotuner.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
from autotuner.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus  # noqa: F401

__all__ = ["GatheredParameters", "Init", "OffloadDeviceEnum", "OffloadStateTypeEnum", "ZeroParamStatus"]
