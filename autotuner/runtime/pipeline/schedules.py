"""The pipeline schedules torch offers, by the config's name for them (pipeline.schedule).

One stage per rank (what DeepSpeed's PipelineModule builds): "1F1B", DeepSpeed's own schedule and
the default, and "GPipe" (every forward, then every backward: more activations held, the same
math). Several stages per rank (`pipeline.stages_per_rank`, ours, 2 by default for these;
Megatron's virtual pipeline size): "Interleaved1F1B", "LoopedBFS" and "InterleavedZeroBubble",
over the looped placement (rank r runs virtual stages r, r + pp, ...). torch's V-shaped schedules
(ZBVZeroBubble, DualPipeV) place a rank's two chunks r and 2 pp - 1 - r, which PipelineModule does
not build yet: refused by name.

torch's 1F1B needs at least as many micro-batches as stages; DeepSpeed's runs with fewer. There
the engine runs GPipe instead, said once: with fewer micro-batches than stages the two hold the
same activations on the first stage (all of them) and compute the same gradients. torch's
Interleaved1F1B needs the micro-batches in whole rounds (a multiple of max(1, m // pp)): else
refused in one line."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)

from autotuner.config.pipeline import DEFAULT_STAGES_PER_RANK, ONE_STAGE_SCHEDULES, SEVERAL_STAGE_SCHEDULES
from autotuner.core.errors import ConfigError

SINGLE_STAGE = dict(zip(ONE_STAGE_SCHEDULES, (Schedule1F1B, ScheduleGPipe)))
SEVERAL_STAGES = dict(zip(SEVERAL_STAGE_SCHEDULES,
                          (ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble)))
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def _known() -> str:
    return ", ".join(repr(k) for k in (*SINGLE_STAGE, *SEVERAL_STAGES))


def stages_per_rank(name: str, given: int | None) -> int:
    """The virtual stages each rank runs under schedule `name`: 1 for one stage per rank, else the
    config's (2 where it is left out); a count the schedule cannot run refused in one line."""
    cls = schedule_class(name)
    several = cls in SEVERAL_STAGES.values()
    if not several:
        if given not in (None, 1):
            raise ConfigError(f"pipeline.stages_per_rank {given}: schedule {name!r} runs one stage per rank; use one of "
                              f"{', '.join(repr(k) for k in SEVERAL_STAGES)} for several, or leave it out")
        return 1
    if given is not None and given < 2:
        raise ConfigError(f"pipeline.stages_per_rank {given}: schedule {name!r} runs several stages on each rank; give "
                          "2 or more, or leave it out (2)")
    return given or DEFAULT_STAGES_PER_RANK


def schedule_for(name: str, micro_batches: int, stages: int) -> tuple[Any, str | None]:
    """The schedule class for `micro_batches` over `stages` pipeline ranks, and the note to say
    where it is not the one named."""
    cls = schedule_class(name)
    if cls is Schedule1F1B and micro_batches < stages:
        return ScheduleGPipe, (f"pipeline.schedule 1F1B: {micro_batches} micro-batch(es) (gradient_accumulation_steps) "
                               f"for {stages} stages, fewer than torch's 1F1B takes; running GPipe, which holds the same "
                               "activations and computes the same gradients at this count")
    if cls is ScheduleInterleaved1F1B:
        rounds = max(1, micro_batches // stages)
        if micro_batches % rounds:
            raise ConfigError(f"pipeline.schedule Interleaved1F1B: {micro_batches} micro-batches "
                              f"(gradient_accumulation_steps) over {stages} stages are not whole rounds of "
                              f"{micro_batches // rounds}; torch's schedule needs a multiple of {rounds}")
    return cls, None


def schedule_class(name: str) -> Any:
    found = {key.lower(): cls for key, cls in {**SINGLE_STAGE, **SEVERAL_STAGES}.items()}.get(name.lower())
    if found is not None:
        return found
    if name.lower() in (key.lower() for key in V_SHAPED):
        raise ConfigError(f"pipeline.schedule: {name!r} places each rank's two stages in a V, which PipelineModule "
                          f"does not build yet; use one of {_known()}")
    if name == "auto":
        raise ConfigError(f"pipeline.schedule \"auto\": a tune (--autotuning tune) searches the schedule and writes "
                          f"the one it picked; to train without one, name one of {_known()}")
    raise ConfigError(f"pipeline.schedule: got {name!r}; expected one of {_known()}")
