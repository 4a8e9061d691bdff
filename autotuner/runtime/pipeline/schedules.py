"""The pipeline schedules torch offers, by the config's name for them (pipeline.schedule).

One stage per rank (what DeepSpeed's PipelineModule builds): "1F1B", DeepSpeed's own schedule and
the default, and "GPipe" (every forward, then every backward: more activations held, the same
math). Several stages per rank (`pipeline.stages_per_rank`, ours, 2 by default for these;
Megatron's virtual pipeline size): "Interleaved1F1B", "LoopedBFS" and "InterleavedZeroBubble"
over the looped placement (rank r runs virtual stages r, r + pp, ...), and torch's V-shaped
zero-bubble ones, "ZBVZeroBubble" and "DualPipeV", over exactly 2 a rank placed r and 2 pp - 1 - r
(so the first rank holds the first and the last stage).

torch's 1F1B needs at least as many micro-batches as stages; DeepSpeed's runs with fewer. There
the engine runs GPipe instead, said once: with fewer micro-batches than stages the two hold the
same activations on the first stage (all of them) and compute the same gradients. torch's
Interleaved1F1B needs the micro-batches in whole rounds (a multiple of max(1, m // pp)), and
DualPipeV at least as many as virtual stages (2 pp): else refused in one line."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)

from autotuner.config.pipeline import (DEFAULT_STAGES_PER_RANK, ONE_STAGE_SCHEDULES, SEVERAL_STAGE_SCHEDULES,
                                       v_shaped)
from autotuner.core.errors import ConfigError

SINGLE_STAGE = dict(zip(ONE_STAGE_SCHEDULES, (Schedule1F1B, ScheduleGPipe)))
SEVERAL_STAGES = dict(zip(SEVERAL_STAGE_SCHEDULES,
                          (ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
                           ScheduleZBVZeroBubble, ScheduleDualPipeV)))


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
    if v_shaped(name) and given not in (None, 2):
        raise ConfigError(f"pipeline.stages_per_rank {given}: schedule {name!r} runs exactly 2 stages on each rank, "
                          "placed in a V; give 2 or leave it out")
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
    if cls is ScheduleDualPipeV and micro_batches < 2 * stages:
        raise ConfigError(f"pipeline.schedule DualPipeV: {micro_batches} micro-batches (gradient_accumulation_steps) "
                          f"for {2 * stages} virtual stages ({stages} ranks x 2); torch's schedule needs at least as "
                          "many micro-batches as virtual stages")
    return cls, None


def schedule_class(name: str) -> Any:
    found = {key.lower(): cls for key, cls in {**SINGLE_STAGE, **SEVERAL_STAGES}.items()}.get(name.lower())
    if found is not None:
        return found
    if name == "auto":
        raise ConfigError(f"pipeline.schedule \"auto\": a tune (--autotuning tune) searches the schedule and writes "
                          f"the one it picked; to train without one, name one of {_known()}")
    raise ConfigError(f"pipeline.schedule: got {name!r}; expected one of {_known()}")
