"""What runs inside each rank: the engine over DDP / ZeRO-1 / FSDP2 (engine.py, initialize.py).

Rooms: training/ (optimizer, sharding, gradients), saving/ (checkpoints, whole weights), measure/ (the
tuner's measurement in a rank), progress/ (DeepSpeed's reports), online/ (the online tuner)."""

from autotuner.runtime.engine import Engine
from autotuner.runtime.initialize import add_config_arguments, initialize

__all__ = ["Engine", "add_config_arguments", "initialize"]


def __getattr__(name: str):
    # DeepSpeed scripts reach these as attributes (deepspeed.runtime.config.LAMB_OPTIMIZER, ...): DeepSpeed's
    # paths, not the engine's modules; they live in autotuner/deepspeed_paths/runtime/ (its aliases.py).
    if name in ("config", "data_pipeline", "domino", "pipe", "utils", "zero"):
        import importlib

        return importlib.import_module(f"autotuner.runtime.{name}")
    raise AttributeError(f"module 'autotuner.runtime' has no attribute {name!r}")
