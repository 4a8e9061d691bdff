"""`deepspeed.runtime.pipe`: the pipeline engine's names, importable and refused when used."""

from autotuner.deepspeed_paths.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
from autotuner.deepspeed_paths.unsupported import unsupported_class

PipelineEngine = unsupported_class("runtime.pipe.PipelineEngine", "pipe")
ProcessTopology = unsupported_class("runtime.pipe.ProcessTopology", "pipe")
