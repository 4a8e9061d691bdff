"""`autotuner.zero` (DeepSpeed's `deepspeed.zero`): its context managers are refused clearly."""

from autotuner.unsupported import refuse


def __getattr__(name: str):
    if name in ("Init", "GatheredParameters"):
        raise refuse(f"zero.{name}")
    raise AttributeError(f"module 'autotuner.zero' has no attribute {name!r}")
