"""The summary's line for a layout a tune searched (a tensor-parallel degree, pipeline stages)."""

from __future__ import annotations

from typing import Sequence

from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.space.search_space import SearchSpace


def kept_line(layout: Layout, space: SearchSpace, objective: Objective, zero_stages: Sequence[int],
              measured: list[TrialResult]) -> str:
    """Its best, and how its global batch was kept (`space`: the layout's; `zero_stages`: the
    config's)."""
    dp = space.data_parallel_size
    top = objective.best(measured)
    line = f"layout: {layout.text()} x data parallel {dp}: kept, {len(measured)} measured"
    if top is not None:
        e = top.experiment
        line += (f", best {top.name} {top.value:.4g} {objective.unit} (global batch {e.train_batch_size(dp)} = "
                 f"micro-batch {e.micro_batch_size} x gas {e.gradient_accumulation_steps} x {dp})")
    if layout.pipeline and any(stage >= 2 for stage in zero_stages):
        line += "; ZeRO 2 and 3 not searched here (the pipeline engine refuses them, as DeepSpeed's does)"
    if space.global_batch_size is not None:
        kind = "train_batch_size" if space.global_batch_exact else "max_train_batch_size"
        line += (f"; {kind} {space.global_batch_size} holds at this layout: micro-batch x gas make up for the "
                 f"data-parallel size, and sizes that cannot are not candidates")
    return line
