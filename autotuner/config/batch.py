"""The batch-size triad: train_batch_size = micro × gas × data-parallel world size."""

from __future__ import annotations

from dataclasses import dataclass

from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int


def train_batch_size(micro_batch_size: int, gradient_accumulation_steps: int, data_parallel_size: int) -> int:
    """Samples per optimizer step: the one place micro x gas x dp is written."""
    return micro_batch_size * gradient_accumulation_steps * data_parallel_size


def data_parallel_size(world_size: int, model_parallel_size: int = 1, source: str = "config",
                       key: str = "autotuning.mp_size") -> int:
    """The ranks that each hold a replica's batch: the world over the model-parallel size (the one
    place it is derived; every rank is data parallel here, so mp_size 1 gives the world size)."""
    size, rest = divmod(world_size, model_parallel_size)
    if size < 1 or rest:
        raise ConfigError(f"{source}: {key}: got {model_parallel_size}; it must divide the world size "
                          f"({world_size})")
    return size


def missing_factor(total: int, known_factors: int, exact: bool = True) -> int | None:
    """The triad solved backwards, the one place it is: the member that makes `known_factors` x it
    equal `total` (`exact`), or the largest that stays within `total` (a cap); None when none
    is 1 or more, or `exact` and `total` is no multiple of `known_factors`."""
    factor, rest = divmod(total, known_factors)
    return None if factor < 1 or (exact and rest) else factor


def gas_for(micro_batch_size: int, data_parallel_size: int, global_batch: int | None, exact: bool) -> int | None:
    """Gas that makes micro × gas × dp reach `global_batch`.

    With a fixed train_batch_size (`exact`) it must divide evenly, else None. With only
    max_train_batch_size it is the largest gas that stays within the cap. No target: 1.
    """
    if global_batch is None:
        return 1
    return missing_factor(global_batch, train_batch_size(micro_batch_size, 1, data_parallel_size), exact)


def _given(value) -> int | None:
    if isinstance(value, list):
        raise ConfigError(
            f"train_micro_batch_size_per_gpu: got the list {value}; a list is only allowed when autotuning "
            "(launcher --autotuning tune|run); give one positive integer to train"
        )
    return None if value in (None, "auto") else int(value)


def resolve_batch(config: DeepSpeedConfig, data_parallel_size: int) -> BatchSizes:
    """Fill in the missing member of the triad, as DeepSpeed does, or report the inconsistency."""
    if data_parallel_size < 1:
        raise ConfigError(f"data-parallel world size must be >= 1, got {data_parallel_size}")
    total = _given(config.train_batch_size)
    micro = _given(config.train_micro_batch_size_per_gpu)
    gas = _given(config.gradient_accumulation_steps)
    dp = data_parallel_size

    if total is not None and micro is not None and gas is not None:
        if total != train_batch_size(micro, gas, dp):
            raise ConfigError(
                f"batch triad is inconsistent: train_batch_size ({total}) != train_micro_batch_size_per_gpu "
                f"({micro}) * gradient_accumulation_steps ({gas}) * data-parallel world size ({dp}) = "
                f"{train_batch_size(micro, gas, dp)}; fix one of them or set it to \"auto\""
            )
    elif total is not None and micro is not None:
        gas = missing_factor(total, train_batch_size(micro, 1, dp))
        if gas is None:
            raise ConfigError(
                f"batch triad is inconsistent: train_batch_size ({total}) is not a multiple of "
                f"train_micro_batch_size_per_gpu ({micro}) * data-parallel world size ({dp})"
            )
    elif total is not None and gas is not None:
        micro = missing_factor(total, train_batch_size(1, gas, dp))
        if micro is None:
            raise ConfigError(
                f"batch triad is inconsistent: train_batch_size ({total}) is not a multiple of "
                f"gradient_accumulation_steps ({gas}) * data-parallel world size ({dp})"
            )
    elif micro is not None:
        gas = gas or 1
        total = train_batch_size(micro, gas, dp)
    elif total is not None:
        gas = 1
        micro = missing_factor(total, dp)
        if micro is None:
            raise ConfigError(
                f"batch triad is inconsistent: train_batch_size ({total}) is not a multiple of the "
                f"data-parallel world size ({dp})"
            )
    else:
        raise ConfigError(
            "batch size is unset: give train_batch_size or train_micro_batch_size_per_gpu "
            "(a positive integer; \"auto\" is settled only by the autotuner or your script)"
        )
    return BatchSizes(total, micro, gas, dp)


def check_fixed_triad(config: DeepSpeedConfig, world_size: int, source: str,
                      stages_from_script: bool = False) -> None:
    """When all three batch values are fixed integers, they must agree before anything launches
    (over every rank or over dp where tensor parallelism divides it: an mpu's script counts dp).

    With `pipeline.stages` a number, over world / (stages x tp), as DeepSpeed's pipeline engine
    counts it (the module's grid is its mpu). `stages_from_script`: the script builds a
    PipelineModule whose stages the config leaves to it (`"auto"`), so any stage count dividing
    the ranks is taken here; the ranks check the one it built."""
    values = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    if not all(isinstance(v, int) for v in values):
        return
    tp, stages = config.tensor_parallel.size, config.pipeline.stages
    try:
        if isinstance(stages, int) and stages > 1:
            if world_size % (stages * tp):
                split = f" x tensor_parallel.autotp_size {tp}" if tp > 1 else ""
                raise ConfigError(f"pipeline.stages {stages}{split}: must divide the number of ranks ({world_size})")
            resolve_batch(config, world_size // (stages * tp))
            return
        try:
            resolve_split_batch(config, world_size, tp, counts_every_rank=True)
        except ConfigError:
            replicas = world_size // max(1, tp)
            if not stages_from_script or not any(
                    _agrees(config, replicas // k) for k in range(2, replicas + 1) if replicas % k == 0):
                raise
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _agrees(config: DeepSpeedConfig, data_parallel: int) -> bool:
    try:
        resolve_batch(config, data_parallel)
    except ConfigError:
        return False
    return True


def resolve_split_batch(config: DeepSpeedConfig, world_size: int, tp_size: int,
                        counts_every_rank: bool) -> tuple[BatchSizes, str | None]:
    """The triad under tensor parallelism, as DeepSpeed 0.19.8 solves it: with an mpu, over the
    data-parallel size (world / tp); without one (a config-only AutoTP run, Hugging Face's Trainer)
    over every rank, TP replicas counted (`counts_every_rank`). Either way a step trains micro x
    gas x dp samples, since a TP group shares one batch; that is what the result holds. A triad
    consistent only over dp is taken too (the tuner writes those). Returns the sizes and, where
    the config's train_batch_size is not the samples a step trains, the line that says so."""
    dp = data_parallel_size(world_size, tp_size, "config", "tensor_parallel.autotp_size")
    if tp_size == 1 or not counts_every_rank:
        return resolve_batch(config, dp), None
    try:
        counted = resolve_batch(config, world_size)
    except ConfigError:
        return resolve_batch(config, dp), None
    trained = BatchSizes(train_batch_size(counted.micro_batch_size, counted.gradient_accumulation_steps, dp),
                         counted.micro_batch_size, counted.gradient_accumulation_steps, dp)
    if not isinstance(config.train_batch_size, int):
        return trained, None  # micro-batch and gas given: both counts agree on what a step trains
    return trained, (f"train_batch_size {counted.train_batch_size} counts all {world_size} ranks, as DeepSpeed does "
                     f"without an mpu; the {tp_size} ranks of a tensor-parallel group share one batch, so a step "
                     f"trains {trained.train_batch_size} samples (micro-batch {trained.micro_batch_size} x gas "
                     f"{trained.gradient_accumulation_steps} x data-parallel size {dp}), as on DeepSpeed")
