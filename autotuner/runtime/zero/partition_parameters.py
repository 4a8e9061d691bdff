"""`deepspeed.runtime.zero.partition_parameters`: ZeroParamStatus, Init and GatheredParameters.

Our ZeRO-3 is FSDP2, which shards a model built the ordinary way, so `Init` is refused. Scripts
enter `GatheredParameters` on every path (with enabled=False, or at stage 0-2): there it does
nothing, as in DeepSpeed where parameters that are not partitioned need no gathering. Entered
for FSDP2's sharded parameters (DTensors), it is refused with what to do instead.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from autotuner.unsupported import refuse


class ZeroParamStatus(Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class Init:
    def __init__(self, *_args: Any, enabled: bool = True, **_kwargs: Any):
        if enabled:
            raise refuse("zero.Init")

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


def _is_sharded(param: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(param, DTensor)


class GatheredParameters:
    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        params = [params] if not isinstance(params, (list, tuple)) and not hasattr(params, "__next__") else list(params)
        if enabled and any(_is_sharded(p) for p in params):
            raise refuse("zero.GatheredParameters")

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: Any) -> None:
        return None
