"""Experiments: frozen, hashable points of the search space, each with a canonical name."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from autotuner.config.batch import train_batch_size
from autotuner.tuning.space import dimensions
from autotuner.tuning.space.layout import SCHEDULE_KEY, TENSOR_PARALLEL_KEY, Layout  # noqa: F401  (the key re-exported)


def _format_knob(value: Any) -> str:
    """Short, and one name per value: a name keys an experiment's directory and its journal record,
    so 1e8 and 100 MiB (104857600) must not both read "1.0e08"."""
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, (int, float)) and value >= 10_000:
        digits = 1
        while float(f"{float(value):.{digits}e}") != value and digits < 17:
            digits += 1
        if isinstance(value, int) and float(f"{float(value):.{digits}e}") != value:
            return str(value)  # beyond a float's 53 bits: the integer itself
        return f"{float(value):.{digits}e}".replace("+", "")
    return str(value)


# A set of dimension values by name, sorted: an experiment's knobs, or a variant of a stage.
Knobs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, order=True)
class Experiment:
    """One training configuration to measure: a ZeRO stage, the batch triad, and a value for each
    further dimension it sets (`knobs`, by name in tuning/space/dimensions.py). `tensor_parallel`
    and `pipeline`: the degree it splits the model over (tensor_parallel.autotp_size) and the
    pipeline stages (pipeline.stages), where the tune sets them (0: the config's layout); they
    divide the ranks, so the data-parallel size the triad counts with is the caller's for that
    layout (layout.py)."""

    zero_stage: int
    micro_batch_size: int
    gradient_accumulation_steps: int = 1
    knobs: Knobs = field(default=())
    tensor_parallel: int = 0
    pipeline: int = 0
    stages_per_rank: int = 0  # the layout's virtual stages per pipeline rank (0: one, or the config's)

    @property
    def layout(self) -> Layout:
        return Layout(self.tensor_parallel, self.pipeline, self.stages_per_rank)

    @property
    def name(self) -> str:
        tags = "".join(f"_{dimensions.tag(k)}{_format_knob(v)}" for k, v in self.knobs)
        return (f"z{self.zero_stage}{self.layout.tag()}{tags}_gas{self.gradient_accumulation_steps}"
                f"_mbs{self.micro_batch_size}")

    def train_batch_size(self, data_parallel_size: int) -> int:
        return train_batch_size(self.micro_batch_size, self.gradient_accumulation_steps, data_parallel_size)

    def with_knobs(self, knobs: dict[str, Any]) -> "Experiment":
        """This experiment with `knobs` added (a knob it already has takes the new value)."""
        merged = {**dict(self.knobs), **knobs}
        return Experiment(self.zero_stage, self.micro_batch_size, self.gradient_accumulation_steps,
                          tuple(sorted(merged.items())), self.tensor_parallel, self.pipeline, self.stages_per_rank)

    def features(self) -> dict[str, float]:
        """Numeric description for cost models."""
        import math

        out = {
            "zero_stage": float(self.zero_stage),
            "log2_micro_batch_size": math.log2(self.micro_batch_size),
            "log2_gradient_accumulation_steps": math.log2(self.gradient_accumulation_steps),
        }
        for key, value in self.knobs:
            out[key] = dimensions.encode(key, value)
        if self.tensor_parallel:
            out["log2_tensor_parallel"] = math.log2(self.tensor_parallel)
        if self.pipeline:
            out["log2_pipeline"] = math.log2(self.pipeline)
        if self.stages_per_rank > 1:
            out["log2_stages_per_rank"] = math.log2(self.stages_per_rank)
        return out

    def searched_schedule(self, base_config: dict[str, Any]) -> str | None:
        """The pipeline schedule this experiment runs where the config's `"schedule": "auto"` searches
        it, by the layout's chunks; None where the tune does not set it."""
        if not self.pipeline or (base_config.get("pipeline") or {}).get("schedule") != "auto":
            return None
        return "Interleaved1F1B" if self.stages_per_rank > 1 else "1F1B"

    def tuned_values_in(self, base_config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        """`tuned_values`, and the schedule where the tune searches it (`base_config`: the run's)."""
        schedule = self.searched_schedule(base_config)
        return self.tuned_values() + (((SCHEDULE_KEY, schedule),) if schedule is not None else ())

    def tuned_values(self) -> tuple[tuple[str, Any], ...]:
        """What this experiment sets, by DeepSpeed config key: the stage, micro-batch and gas, and
        each dimension at its path (what the ranks must build, and report back)."""
        layout = self.layout.tuned_values()
        return (("zero_optimization.stage", self.zero_stage),
                ("train_micro_batch_size_per_gpu", self.micro_batch_size),
                ("gradient_accumulation_steps", self.gradient_accumulation_steps),
                *layout,
                *((".".join(dimensions.dimension(key).path), value) for key, value in self.knobs))

    def apply(self, base_config: dict[str, Any], data_parallel_size: int) -> dict[str, Any]:
        """The base config with this experiment's stage, batch triad and dimensions set."""
        config = copy.deepcopy(base_config)
        config["zero_optimization"] = {**(config.get("zero_optimization") or {}), "stage": self.zero_stage}
        if self.tensor_parallel:
            config["tensor_parallel"] = {**(config.get("tensor_parallel") or {}), "autotp_size": self.tensor_parallel}
        if self.pipeline:
            config["pipeline"] = {**(config.get("pipeline") or {}), "stages": self.pipeline}
            schedule = self.searched_schedule(base_config)
            if schedule is not None:
                config["pipeline"]["schedule"] = schedule
        if self.stages_per_rank > 1:
            config["pipeline"] = {**(config.get("pipeline") or {}), "stages_per_rank": self.stages_per_rank}
        for key, value in self.knobs:
            dimensions.write(config, dimensions.dimension(key).path, value)
        config["train_micro_batch_size_per_gpu"] = self.micro_batch_size
        config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        config["train_batch_size"] = self.train_batch_size(data_parallel_size)
        return config

