"""`deepspeed.moe.layer`: `MoE` is importable and refused when built."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

MoE = unsupported_class("moe.layer.MoE", "moe")
