"""`deepspeed.runtime.zero.partition_parameters`: ZeroParamStatus, Init and GatheredParameters.

Our ZeRO-3 is FSDP2, which shards a model built the ordinary way at initialize, so `Init` is a
context that does nothing: the model trains as under DeepSpeed's Init, but each rank builds it
whole first (its memory then, not its training, differs). `GatheredParameters` does what
DeepSpeed's does for FSDP2's sharded parameters (DTensors, ZeRO 2 and 3 here): every rank
entering it sees them whole, through the parameter's `.data` and the module's attribute, and with
`modifier_rank` that rank's changes reach every shard on exit (runtime/saving/whole_weights.py).
Parameters DeepSpeed's own zero.Init partitioned (a model transformers built under it, not yet
through our initialize) are gathered by DeepSpeed's own `GatheredParameters`, changes written back
alike. Entered with enabled=False, or for parameters that are whole already (stage 0-1), it does
nothing, as in DeepSpeed; anything else it was given and cannot gather is refused in one line.
"""

from __future__ import annotations

from typing import Any

from autotuner.runtime.distributed import warn_once
from autotuner.runtime.saving.whole_weights import Gathering, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]


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
        if params is None:
            params = []
        elif not isinstance(params, (list, tuple)) and not hasattr(params, "__next__"):
            params = [params]
        params = list(params)
        self._contexts = []
        if not enabled:
            return
        # A model DeepSpeed's own zero.Init partitioned (built while transformers' HfDeepSpeedConfig
        # at ZeRO 3 was alive, before our initialize gathered it whole): DeepSpeed's own context
        # gathers those partitions and writes modifier_rank's changes back into them.
        partitions = [p for p in params if "ds_tensor" in getattr(p, "__dict__", {})]
        if partitions:
            import sys

            self._contexts.append(sys.modules["deepspeed"].zero.GatheredParameters(
                partitions, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=True))
        ours = [p for p in params if "ds_tensor" not in getattr(p, "__dict__", {})]
        self._contexts.append(Gathering(ours, modifier_rank))

    def __enter__(self) -> None:
        for entered, context in enumerate(self._contexts):
            try:
                context.__enter__()
            except BaseException:
                for earlier in reversed(self._contexts[:entered]):
                    earlier.__exit__(None, None, None)
                raise

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
