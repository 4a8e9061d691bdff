"""deepspeed.monitor.config: the monitor sections, as the config models define them."""

from autotuner.config.reporting import CSVConfig, TensorBoardConfig, WandbConfig  # noqa: F401
