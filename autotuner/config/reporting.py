"""The DeepSpeed config sections that say what a run reports: monitors, the flops profiler, timers.

Names, defaults and meanings are DeepSpeed's (deepspeed/monitor/config.py, profiling/config.py,
runtime/config.py at 0.19.8), so a user's config keeps its curves when the import changes.
"""

from __future__ import annotations

from pydantic import Field, NonNegativeFloat

from autotuner.config.base import Section


class TensorBoardConfig(Section):
    """`tensorboard`: event files under output_path/job_name, written by rank 0."""

    enabled: bool = False
    output_path: str = Field("", description="folder of the job folder; \"\" is the launch directory")
    job_name: str = "DeepSpeedJobName"


class CSVConfig(Section):
    """`csv_monitor`: one CSV per event name under output_path/job_name, written by rank 0."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """`wandb`: wandb.init(project, group, entity=team) on rank 0 (WANDB_MODE=offline works)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class FlopsProfilerConfig(Section):
    """`flops_profiler`: the profile of one training step, printed by rank 0."""

    enabled: bool = False
    recompute_fwd_factor: NonNegativeFloat = Field(
        0.0, description="forward passes recomputed in backward (activation checkpointing), for bwd FLOPS")
    profile_step: int = Field(1, ge=1, description="completed optimizer steps before the profiled one")
    module_depth: int = Field(-1, ge=-1, description="depth of the per-module listing; -1 is all")
    top_modules: int = Field(1, ge=1, description="modules listed per depth in the aggregated profile")
    detailed: bool = True
    output_file: str | None = Field(None, description="write the profile here instead of stdout")


class ThroughputTimerConfig(Section):
    enabled: bool = True
    synchronized: bool = Field(True, description="synchronise the device before reading the clock")


class TimersConfig(Section):
    """`timers`: DeepSpeed's engine.tput_timer settings."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
