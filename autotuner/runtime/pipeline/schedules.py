"""The pipeline schedules torch offers, by the config's name for them (pipeline.schedule).

One stage per rank (what DeepSpeed's PipelineModule builds): "1F1B", DeepSpeed's own schedule and
the default, and "GPipe" (every forward, then every backward: more activations held, the same
math). torch's looped and interleaved schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV) run several stages per rank, which a PipelineModule does not build yet:
they are refused by name."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from autotuner.core.errors import ConfigError

SINGLE_STAGE = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
SEVERAL_STAGES_PER_RANK = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_class(name: str) -> Any:
    found = {key.lower(): cls for key, cls in SINGLE_STAGE.items()}.get(name.lower())
    if found is not None:
        return found
    if name.lower() in (key.lower() for key in SEVERAL_STAGES_PER_RANK):
        raise ConfigError(f"pipeline.schedule: {name!r} runs several stages on each rank, which PipelineModule does "
                          f"not build yet; use one of {', '.join(repr(k) for k in SINGLE_STAGE)}")
    raise ConfigError(f"pipeline.schedule: got {name!r}; expected one of {', '.join(repr(k) for k in SINGLE_STAGE)}")
