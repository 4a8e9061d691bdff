"""`deepspeed.runtime.zero`: the names scripts import from DeepSpeed's ZeRO package. Our engine's
ZeRO stages (DDP, ZeroRedundancyOptimizer, FSDP2) are in autotuner.runtime.training.sharding."""

# offload_config and partition_parameters are attributes, as in DeepSpeed.
from autotuner.deepspeed_paths.runtime.zero import offload_config, partition_parameters  # noqa: F401
from autotuner.deepspeed_paths.runtime.zero.partition_parameters import GatheredParameters, Init  # noqa: F401
