"""`deepspeed.runtime.pipe.topology`: the process grids (autotuner/runtime/pipeline/topology.py)."""

from autotuner.runtime.pipeline.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                 ProcessTopology)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
