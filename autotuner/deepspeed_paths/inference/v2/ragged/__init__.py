"""`deepspeed.inference.v2.ragged`: importable; refused when configured."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

DSStateManagerConfig = unsupported_class("inference.v2.ragged.DSStateManagerConfig", "init_inference")
