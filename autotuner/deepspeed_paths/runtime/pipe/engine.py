"""`deepspeed.runtime.pipe.engine`: the pipeline engine's class and its error."""

from autotuner.runtime.pipeline.engine import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
