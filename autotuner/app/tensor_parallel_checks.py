"""The tensor-parallel degrees a tune runs, settled before any launch: the config's fixed degree,
or the degrees `"auto"` (the divisors of the ranks per node: TP stays inside a node) or a list
asks to search, each kept or left out with the reason said; what a TP tune cannot carry refused."""

from __future__ import annotations

import json
from typing import Callable

from autotuner.core.engine_kind import Engine
from autotuner.app.engines import EngineChoice
from autotuner.config.batch import check_fixed_triad
from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError, UsageError
from autotuner.tuning.space.search_space import SearchSpace


def check_tensor_parallel_tune(config: DeepSpeedConfig, engine: EngineChoice, source: str) -> None:
    """A tune with a tensor-parallel degree above 1 (fixed or among those searched): our engine
    only, and what it refuses there refused before any launch."""
    section = config.tensor_parallel
    size = json.dumps(section.autotp_size)
    if not (engine.settled and engine.engine == Engine.OURS):
        raise UsageError(f"{source}: tensor_parallel.autotp_size {size}: a tensor-parallel tune runs on autotuner's "
                         f"engine only ({engine.reason}); import autotuner in the script, or pass --engine autotuner")
    if config.autotuning.metric == "goodput":
        raise ConfigError(f"{source}: autotuning.metric \"goodput\" with tensor_parallel.autotp_size {size}: the "
                          "gradient noise is not read under tensor parallelism yet; use metric \"throughput\"")


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


def kept_degrees(config: DeepSpeedConfig, space: SearchSpace, degrees: tuple[int, ...], ranks: int, source: str,
                 say: Callable[[str], None],
                 batch_is_valid: Callable[[SearchSpace, int, str], None]
                 ) -> tuple[tuple[int, ...], tuple[tuple[int, str], ...]]:
    """The searched degrees that have something to run, and (degree, why) for each left out, said;
    none kept is refused with the first degree's reason. `ranks`: what the degrees divide (the
    data-parallel size at degree 1); `batch_is_valid` refuses a space with no valid global batch."""
    kept, reasons, left_out = [], [], []
    for degree in degrees:
        at = space.at_degree(degree, ranks)
        try:
            check_fixed_triad(at_degree(config, degree), at.data_parallel_size, source)
            batch_is_valid(at, at.data_parallel_size, source)
        except ConfigError as err:
            reasons.append(err)
            left_out.append((degree, str(err).removeprefix(source + ": ")))
            say(f"tensor parallel {degree}: left out ({left_out[-1][1]})")
            continue
        kept.append(degree)
    if not kept:
        raise reasons[0]
    say(f"tensor parallel: searching degrees {', '.join(map(str, kept))} (each profiled at its own degree, data-"
        f"parallel size {', '.join(str(ranks // d) for d in kept)})")
    return tuple(kept), tuple(left_out)
