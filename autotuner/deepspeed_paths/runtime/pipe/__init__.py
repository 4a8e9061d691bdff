"""`deepspeed.runtime.pipe`: the pipeline module, its specs, the topologies and the engine's class."""

from autotuner.runtime.pipeline.engine import PipelineEngine, PipelineError
from autotuner.runtime.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from autotuner.runtime.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                 ProcessTopology)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine",
           "PipelineError", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
