"""`deepspeed.runtime.zero`: the names scripts import from DeepSpeed's ZeRO package. Our engine's
ZeRO stages (DDP, ZeroRedundancyOptimizer, FSDP2) are in autotuner.runtime.sharding."""

from autotuner.runtime.zero import offload_config, partition_parameters  # noqa: F401 - attributes, as in DeepSpeed
from autotuner.runtime.zero.partition_parameters import GatheredParameters, Init  # noqa: F401
