"""`deepspeed.moe`: importable; building a mixture-of-experts layer is refused (moe/layer.py)."""

from autotuner.deepspeed_paths.moe import layer, utils  # noqa: F401 - reachable as attributes, as in DeepSpeed
