"""`deepspeed.pipe`: importable; a PipelineModule is refused when built."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

PipelineModule = unsupported_class("pipe.PipelineModule", "pipe")
LayerSpec = unsupported_class("pipe.LayerSpec", "pipe")
TiedLayerSpec = unsupported_class("pipe.TiedLayerSpec", "pipe")
