"""`pipeline`: DeepSpeed's pipeline section (its keys and defaults), with the schedule ours.

DeepSpeed parses `stages`, `partition` and `seed_layers` and does not use them: the script's
PipelineModule(num_stages=..., partition_method=..., seed_layers=...) decides. Here `stages`, where
given as a number, is checked against what the module built (a config and a script that disagree
are refused), `partition` and `seed_layers` are left as DeepSpeed leaves them (the module's
arguments decide, said once when they differ from the default), and `activation_checkpoint_interval`
above 0 overrides the module's, as in DeepSpeed. `schedule` is torch's schedule the engine runs
(runtime/pipeline/schedules.py); DeepSpeed's own is 1F1B. `stages_per_rank` is ours: the virtual
stages (chunks) each rank runs under the schedules that run several, the layers re-placed at
initialize (PipelineModule.place_virtual_stages)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from autotuner.config.base import NonNegativeInt, PositiveInt, Section


# torch's schedule names (runtime/pipeline/schedules.py maps them to its classes).
ONE_STAGE_SCHEDULES = ("1F1B", "GPipe")
SEVERAL_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Each rank's two stages placed in a V (r and 2 pp - 1 - r), not looped (r, r + pp, ...).
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
DEFAULT_STAGES_PER_RANK = 2  # for a schedule of several stages per rank, where the config leaves it


def runs_several_stages(schedule: str) -> bool:
    return schedule.lower() in (name.lower() for name in SEVERAL_STAGE_SCHEDULES)


def v_shaped(schedule: str) -> bool:
    return schedule.lower() in (name.lower() for name in V_SHAPED_SCHEDULES)


class PipelineConfig(Section):
    stages: PositiveInt | Literal["auto"] | list[PositiveInt] = Field(
        "auto", description='pipeline stages; "auto" (DeepSpeed\'s default): as the script\'s PipelineModule '
                            "builds them; a number is checked against it. In a tune whose arg_mappings maps "
                            "pipeline.stages to the script's flag: \"auto\" searches every divisor of the ranks, "
                            "a list those listed, a number fixes it")
    partition: str = Field("best", description="DeepSpeed parses it and leaves the split to "
                                               "PipelineModule(partition_method=...); so here")
    seed_layers: bool = Field(False, description="DeepSpeed parses it and leaves it to PipelineModule(seed_layers=...); "
                                                 "so here")
    activation_checkpoint_interval: NonNegativeInt = Field(
        0, description="above 0: layers per checkpointed chunk, over the PipelineModule's own value")
    pipe_partitioned: bool = Field(True, description="DeepSpeed's split of activations sent over a tensor-parallel "
                                                     "group; with no model axis it has no effect there or here")
    grad_partitioned: bool = Field(True, description="the same for the gradients sent back")
    use_reentrant: bool = Field(True, description="DeepSpeed's checkpoint flavour; the math is the same either way "
                                                  "(torch's non-reentrant checkpoint runs here)")
    schedule: str = Field("1F1B", description='torch\'s pipeline schedule: "1F1B" (DeepSpeed\'s) or "GPipe" (one stage '
                                            'per rank); "Interleaved1F1B", "LoopedBFS" or "InterleavedZeroBubble" '
                                            '(several: stages_per_rank, looped), "ZBVZeroBubble" or "DualPipeV" '
                                            '(2 a rank, in a V); "auto" in a tune: 1F1B against '
                                            'Interleaved1F1B')
    stages_per_rank: PositiveInt | None = Field(
        None, description="ours (Megatron's virtual pipeline size): the chunks each rank runs under a schedule of "
                          "several stages per rank (2 where left out); 1 for 1F1B and GPipe")
