"""The pipeline schedules torch offers, by the config's name for them (pipeline.schedule).

One stage per rank (what DeepSpeed's PipelineModule builds): "1F1B", DeepSpeed's own schedule and
the default, and "GPipe" (every forward, then every backward: more activations held, the same
math). torch's looped and interleaved schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV) run several stages per rank, which a PipelineModule does not build yet:
they are refused by name.

torch's 1F1B needs at least as many micro-batches as stages; DeepSpeed's runs with fewer. There
the engine runs GPipe instead, said once: with fewer micro-batches than stages the two hold the
same activations on the first stage (all of them) and compute the same gradients."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from autotuner.core.errors import ConfigError

SINGLE_STAGE = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
SEVERAL_STAGES_PER_RANK = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_for(name: str, micro_batches: int, stages: int) -> tuple[Any, str | None]:
    """The schedule class for `micro_batches` over `stages`, and the note to say where it is not
    the one named."""
    cls = schedule_class(name)
    if cls is Schedule1F1B and micro_batches < stages:
        return ScheduleGPipe, (f"pipeline.schedule 1F1B: {micro_batches} micro-batch(es) (gradient_accumulation_steps) "
                               f"for {stages} stages, fewer than torch's 1F1B takes; running GPipe, which holds the same "
                               "activations and computes the same gradients at this count")
    return cls, None


def schedule_class(name: str) -> Any:
    found = {key.lower(): cls for key, cls in SINGLE_STAGE.items()}.get(name.lower())
    if found is not None:
        return found
    if name.lower() in (key.lower() for key in SEVERAL_STAGES_PER_RANK):
        raise ConfigError(f"pipeline.schedule: {name!r} runs several stages on each rank, which PipelineModule does "
                          f"not build yet; use one of {', '.join(repr(k) for k in SINGLE_STAGE)}")
    raise ConfigError(f"pipeline.schedule: got {name!r}; expected one of {', '.join(repr(k) for k in SINGLE_STAGE)}")
