"""`deepspeed.utils.logging`: the script logger and log_dist (autotuner.utils's)."""

from autotuner.deepspeed_paths.utils import log_dist, logger  # noqa: F401
