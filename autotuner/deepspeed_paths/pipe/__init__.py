"""`deepspeed.pipe`: DeepSpeed's pipeline module and layer specs (autotuner/runtime/pipeline/)."""

from autotuner.runtime.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from autotuner.runtime.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                 ProcessTopology)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]
