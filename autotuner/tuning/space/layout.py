"""A layout: how a tune splits the model over the ranks besides data parallelism, the key each
layout's profile, memory model and search are kept apart by (the orchestrator searches one
layout after another). Pure records."""

from __future__ import annotations

from dataclasses import dataclass

TENSOR_PARALLEL_KEY = "tensor_parallel.autotp_size"
PIPELINE_KEY = "pipeline.stages"
STAGES_PER_RANK_KEY = "pipeline.stages_per_rank"
SCHEDULE_KEY = "pipeline.schedule"  # set by a tune only where `"schedule": "auto"` searches it


@dataclass(frozen=True, order=True)
class Layout:
    """The tensor-parallel degree and the pipeline stages an experiment sets. 0 in either: the tune
    does not set it (the config's layout stands: data parallel, or the script's own pipeline)."""

    tensor_parallel: int = 0
    pipeline: int = 0
    # Virtual stages (chunks) per pipeline rank under a schedule of several (Interleaved1F1B,
    # LoopedBFS): they re-place the layers, so a count is a layout of its own, profiled apart.
    # 0: one stage per rank, or the config's count where the tune does not set the stages.
    stages_per_rank: int = 0

    @property
    def model_ranks(self) -> int:
        """Ranks one model replica spans: the data-parallel size is the world over this."""
        return max(1, self.tensor_parallel) * max(1, self.pipeline)

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1

    def text(self) -> str:
        """"tensor parallel 2", "pipeline 2 x tensor parallel 2", "pipeline 2 (2 stages per rank)":
        the summary's words."""
        parts = [f"pipeline {self.pipeline}"] if self.pipeline else []
        if self.stages_per_rank > 1:
            parts = [f"{parts[0]} ({self.stages_per_rank} stages per rank)"]
        if self.tensor_parallel or not parts:
            parts.append(f"tensor parallel {max(1, self.tensor_parallel)}")
        return " x ".join(parts)

    def tag(self) -> str:
        """In an experiment's name: `_pp2_tp2`, `_pp2v2` (nothing for what the tune does not set)."""
        pipeline = f"_pp{self.pipeline}" if self.pipeline else ""
        chunks = f"v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return pipeline + chunks + (f"_tp{self.tensor_parallel}" if self.tensor_parallel else "")

    def tuned_values(self) -> tuple[tuple[str, int], ...]:
        """What the ranks must build, by config key (and report back)."""
        return (((TENSOR_PARALLEL_KEY, self.tensor_parallel),) if self.tensor_parallel else ()) + \
            (((PIPELINE_KEY, self.pipeline),) if self.pipeline else ()) + \
            (((STAGES_PER_RANK_KEY, self.stages_per_rank),) if self.stages_per_rank > 1 else ())
