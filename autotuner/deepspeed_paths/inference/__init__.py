"""`deepspeed.inference`: importable; inference engines are refused when configured."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

RaggedInferenceEngineConfig = unsupported_class("inference.RaggedInferenceEngineConfig", "init_inference")
DeepSpeedTPConfig = unsupported_class("inference.DeepSpeedTPConfig", "init_inference")
