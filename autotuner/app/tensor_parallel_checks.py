"""What a tune at a fixed tensor-parallel degree needs, refused before any launch where it is missing."""

from __future__ import annotations

from autotuner.app.engines import EngineChoice
from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError, UsageError


def check_tensor_parallel_tune(config: DeepSpeedConfig, engine: EngineChoice, source: str) -> None:
    """A tune at a fixed tensor-parallel degree: our engine only, and what it refuses there refused
    before any launch. The degree itself is not searched yet."""
    size = config.tensor_parallel.autotp_size
    if not (engine.settled and engine.engine == "autotuner"):
        raise UsageError(f"{source}: tensor_parallel.autotp_size {size}: a tensor-parallel tune runs on autotuner's "
                         f"engine only ({engine.reason}); import autotuner in the script, or pass --engine autotuner")
    stage = config.zero_optimization.stage
    if stage == 1 or (isinstance(stage, list) and 1 in stage):
        raise ConfigError(f"{source}: zero_optimization.stage: 1 with tensor_parallel.autotp_size {size} is not carried "
                          "by autotuner's engine; search 0, 2 and 3 (\"all\" leaves 1 out by itself)")
    if config.autotuning.metric == "goodput":
        raise ConfigError(f"{source}: autotuning.metric \"goodput\" with tensor_parallel.autotp_size {size}: the "
                          "gradient noise is not read under tensor parallelism yet; use metric \"throughput\"")


def degree_dividing(config: DeepSpeedConfig, world_size: int, source: str) -> int:
    """The config's tensor-parallel degree, refused where it does not divide the ranks."""
    degree = config.tensor_parallel.size
    if degree > 1 and world_size % degree:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size {degree}: must divide the number of ranks "
                          f"({world_size})")
    return degree
