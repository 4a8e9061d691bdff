"""DeepSpeed-compatible config: models, loading, batch-triad resolution."""

from autotuner.config.batch import BatchSizes, resolve_batch
from autotuner.config.fill import fill_auto
from autotuner.config.loader import load_config, read_config_file
from autotuner.config.autotuning import AutotuningConfig
from autotuner.config.models import (
    DeepSpeedConfig,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

__all__ = [
    "AutotuningConfig",
    "BatchSizes",
    "DeepSpeedConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "fill_auto",
    "load_config",
    "read_config_file",
    "resolve_batch",
]
