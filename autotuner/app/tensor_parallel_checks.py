"""The tensor-parallel degrees a tune runs, settled before any launch: the config's fixed degree,
or the degrees `"auto"` (the divisors of the ranks per node: TP stays inside a node) or a list
asks to search; what a TP tune cannot carry refused. Which layouts are kept: layout_checks.py."""

from __future__ import annotations

import json
from autotuner.core.engine_kind import Engine
from autotuner.app.engines import EngineChoice
from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError, UsageError


def check_layout_tune(config: DeepSpeedConfig, engine: EngineChoice, source: str, key: str, kind: str,
                      noise: str) -> None:
    """A tune that sets a layout (`key` and its words, `kind`: "a tensor-parallel tune"): our
    engine only, and goodput refused where the gradient noise is not read (`noise`: where)."""
    if not (engine.settled and engine.engine == Engine.OURS):
        raise UsageError(f"{source}: {key}: {kind} runs on autotuner's engine only ({engine.reason}); import "
                         "autotuner in the script, or pass --engine autotuner")
    if config.autotuning.metric == "goodput":
        raise ConfigError(f"{source}: autotuning.metric \"goodput\" with {key}: the gradient noise is not read "
                          f"{noise}; use metric \"throughput\"")


def check_tensor_parallel_tune(config: DeepSpeedConfig, engine: EngineChoice, source: str) -> None:
    """A tune with a tensor-parallel degree above 1 (fixed or among those searched): our engine
    only, and what it refuses there refused before any launch."""
    size = json.dumps(config.tensor_parallel.autotp_size)
    check_layout_tune(config, engine, source, f"tensor_parallel.autotp_size {size}", "a tensor-parallel tune",
                      "under tensor parallelism yet")


def degree_dividing(config: DeepSpeedConfig, world_size: int, source: str) -> int:
    """The config's fixed tensor-parallel degree, refused where it does not divide the ranks."""
    degree = config.tensor_parallel.size
    if degree > 1 and world_size % degree:
        raise ConfigError(f"{source}: tensor_parallel.autotp_size {degree}: must divide the number of ranks "
                          f"({world_size})")
    return degree


def settled_degrees(config: DeepSpeedConfig, world_size: int, ranks_per_node: int, source: str) -> tuple[int, ...]:
    """The degrees the tune runs: the config's one, or those it searches ("auto": every divisor of
    the ranks per node; a list: each must divide the ranks)."""
    section = config.tensor_parallel
    if not section.searched:
        return (degree_dividing(config, world_size, source),)
    if section.autotp_size == "auto":
        return tuple(d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0 and world_size % d == 0)
    for degree in section.autotp_size:
        if world_size % degree:
            raise ConfigError(f"{source}: tensor_parallel.autotp_size: {degree} in {json.dumps(section.autotp_size)} "
                              f"does not divide the number of ranks ({world_size}); list divisors of it, or give "
                              "\"auto\"")
    return tuple(sorted(set(section.autotp_size)))


def at_degree(config: DeepSpeedConfig, degree: int) -> DeepSpeedConfig:
    """The config as an experiment at `degree` reads it (autotp_size settled)."""
    return config.model_copy(update={"tensor_parallel": config.tensor_parallel.model_copy(
        update={"autotp_size": degree})})
