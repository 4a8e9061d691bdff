"""What runs inside each rank: the engine over DDP / ZeRO-1 / FSDP2, timers, metrics, checkpoints."""

from autotuner.runtime.engine import Engine
from autotuner.runtime.initialize import add_config_arguments, initialize

__all__ = ["Engine", "add_config_arguments", "initialize"]
