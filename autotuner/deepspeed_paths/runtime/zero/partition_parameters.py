"""`deepspeed.runtime.zero.partition_parameters`: ZeroParamStatus, Init and GatheredParameters.

Our ZeRO-3 is FSDP2, which shards a model built the ordinary way at initialize, so `Init` is a
context that does nothing: the model trains as under DeepSpeed's Init, but each rank builds it
whole first (its memory then, not its training, differs). Scripts
enter `GatheredParameters` on every path (with enabled=False, or at stage 0-2): there it does
nothing, as in DeepSpeed where parameters that are not partitioned need no gathering. Entered
for FSDP2's sharded parameters (DTensors), it is refused with what to do instead.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from autotuner.runtime.distributed import warn_once
from autotuner.deepspeed_paths.unsupported import refuse


class ZeroParamStatus(Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class Init:
    # DeepSpeed's parameters, so calls that name them read the same; none changes what FSDP2 does.
    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None,
                 zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group: Any = None,
                 param_swapper: Any = None, tensor_overrides: Any = None):
        if enabled:
            warn_once("zero.Init: the model is built whole on each rank and sharded by FSDP2 at initialize "
                      "(ZeRO stage 3 here)")

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


class GatheredParameters:
    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        params = [params] if not isinstance(params, (list, tuple)) and not hasattr(params, "__next__") else list(params)
        from autotuner.runtime.sharding import is_dtensor

        if enabled and any(is_dtensor(p) for p in params):
            raise refuse("zero.GatheredParameters")

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: Any) -> None:
        return None
