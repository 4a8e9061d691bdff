"""`deepspeed.runtime.pipe.module`: PipelineModule and its layer specs."""

from autotuner.runtime.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
