"""Trial outcomes: a state enum and an immutable result record. Failures are recorded, never raised."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from autotuner.core.boundary import Measurement, ModelInfo
from autotuner.tuning.space.experiment import Experiment


class TrialState(str, enum.Enum):
    OK = "ok"
    OOM = "oom"
    FAILED = "failed"
    TIMEOUT = "timeout"
    PRUNED = "pruned"

    @property
    def finished(self) -> bool:
        """A state that a resumed run can reuse (it ran to a verdict)."""
        return self is not TrialState.PRUNED


class Reason(str, enum.Enum):
    """Why a trial was not launched, or did not count: what the tuner acts on. The result's
    `error` holds the text for display; nothing decides by that text."""

    MEMORY_MODEL = "memory model"  # predicted not to fit
    MEMORY_REFITTED = "memory model, refitted"  # the memory model refitted on launches rules it out
    SHARDING_CANNOT_WIN = "sharding cannot win"  # the cost model: unsharded fits and is faster
    CANNOT_HELP = "cannot help"  # a variant reaching no larger micro-batch than one before it
    NOT_MEMORY_BOUND = "not memory bound"  # a memory-saving variant where memory did not limit
    VARIANT_FAILED = "variant failed"  # a variant whose first launch did not run
    PREDICTION = "prediction"  # the step-time model says it cannot beat the best
    VARIANT_RULES = "variant rules"  # refused by the rules on a failed variant
    MISSING_METRIC = "missing metric"  # the metrics file lacks the objective's figure
    BUILT_OTHERWISE = "built otherwise"  # the ranks built other values than the experiment's
    OVER_BUDGET = "over budget"  # peak memory over the per-rank budget

    @property
    def never_launched(self) -> bool:
        """A pruned stage or variant that was not launched at all (else: launched, searched no further)."""
        return self in (Reason.MEMORY_MODEL, Reason.MEMORY_REFITTED, Reason.SHARDING_CANNOT_WIN)


METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "FLOPS": "FLOPS_per_gpu", "goodput": "throughput"}


@dataclass(frozen=True)
class Objective:
    """Which metric decides, and whether larger is better (latency is minimised).

    "goodput" is throughput times the statistical efficiency of the experiment's global batch
    against `reference_batch` (core/noise_scale.py); `noise_scale` is B_noise as the profile
    measured it, or the config's critical_batch_size, and until it is set a goodput value is the
    plain throughput."""

    metric: Literal["throughput", "latency", "FLOPS", "goodput"] = "throughput"
    reference_batch: int | None = None  # goodput: the global batch the learning rate was chosen for
    noise_scale: float | None = None  # goodput: B_noise (or the critical batch given), once settled

    @property
    def key(self) -> str:
        return METRIC_KEYS[self.metric]

    @property
    def unit(self) -> str:
        return {"throughput": "samples/s", "latency": "s per step", "FLOPS": "FLOP/s per rank",
                "goodput": "samples/s x efficiency"}[self.metric]

    def efficiency(self, global_batch: int | None) -> float:
        """The goodput factor of a global batch; 1 for the other metrics, or before B_noise is known."""
        if self.metric != "goodput" or self.noise_scale is None or not global_batch or not self.reference_batch:
            return 1.0
        return (self.noise_scale + self.reference_batch) / (self.noise_scale + global_batch)

    @property
    def maximize(self) -> bool:
        return self.metric != "latency"

    def better(self, candidate: float, incumbent: float | None) -> bool:
        if incumbent is None:
            return True
        return candidate > incumbent if self.maximize else candidate < incumbent

    def rank(self, results: Iterable["TrialResult"],
             value: Callable[["TrialResult"], float | None] | None = None) -> list["TrialResult"]:
        """The results that ran with a value, best first (ties keep their order): the one ranking
        every pick, progress line, summary row and search rule uses. `value`: what to rank by
        (a median of re-measurements, say); each result's own value by default."""
        of = value or (lambda r: r.value)
        return self.order([r for r in results if r.state is TrialState.OK and of(r) is not None], of)

    def best(self, results: Iterable["TrialResult"],
             value: Callable[["TrialResult"], float | None] | None = None) -> "TrialResult | None":
        ranked = self.rank(results, value)
        return ranked[0] if ranked else None

    def order(self, items: Iterable[Any], value: Callable[[Any], float] = float) -> list[Any]:
        """Any items by `value`, best first, ties in their order (plain values by default: medians, say)."""
        return sorted(items, key=value, reverse=self.maximize)


@dataclass(frozen=True)
class TrialResult:
    """What one launch gave. `value` is the objective's metric; None unless state is OK.
    `measurement` is what the ranks measured, `model_info` what a profile launch recorded."""

    experiment: Experiment
    state: TrialState
    value: float | None = None
    value_std: float | None = None
    measurement: Measurement | None = field(default=None, compare=False)
    predicted_memory_bytes: int | None = None
    measured_memory_bytes: int | None = None
    wall_time_s: float = 0.0
    error: str | None = None
    model_info: ModelInfo | None = field(default=None, compare=False)
    reason: Reason | None = None  # why it was not launched or did not count, where the tuner acts on it
    hosts: tuple[str, ...] = field(default=(), compare=False)  # where it ran on a cluster (Slurm node names, Ray nodes)

    @property
    def name(self) -> str:
        return self.experiment.name

    @property
    def relative_error(self) -> float:
        """How far the window's mean may be off, relative to it: the per-step spread over the
        square root of the steps timed (the per-step spread itself where the count is unknown).
        Not the run-to-run noise: callers floor it with that."""
        if not self.value_std or not self.value:
            return 0.0
        spread = abs(self.value_std / self.value)
        m = self.measurement
        if m is None or m.start_profile_step is None or m.end_profile_step is None:
            return spread
        return spread / max(1, m.end_profile_step - m.start_profile_step + 1) ** 0.5

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "experiment": {"zero_stage": self.experiment.zero_stage,
                           "micro_batch_size": self.experiment.micro_batch_size,
                           "gradient_accumulation_steps": self.experiment.gradient_accumulation_steps,
                           "knobs": [list(kv) for kv in self.experiment.knobs],
                           "tensor_parallel": self.experiment.tensor_parallel,
                           "pipeline": self.experiment.pipeline,
                           "stages_per_rank": self.experiment.stages_per_rank},
            "state": self.state.value,
            "value": self.value,
            "value_std": self.value_std,
            "metrics": self.measurement.to_json() if self.measurement is not None else None,
            "model_info": self.model_info.to_json() if self.model_info is not None else None,
            "predicted_memory_bytes": self.predicted_memory_bytes,
            "measured_memory_bytes": self.measured_memory_bytes,
            "wall_time_s": self.wall_time_s,
            "error": self.error,
            "reason": self.reason.value if self.reason is not None else None,
            "hosts": list(self.hosts),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrialResult":
        exp = data["experiment"]
        experiment = Experiment(exp["zero_stage"], exp["micro_batch_size"], exp["gradient_accumulation_steps"],
                                tuple((k, v) for k, v in exp.get("knobs", [])), exp.get("tensor_parallel", 0),
                                exp.get("pipeline", 0), exp.get("stages_per_rank", 0))
        return cls(
            experiment=experiment,
            state=TrialState(data["state"]),
            value=data.get("value"),
            value_std=data.get("value_std"),
            measurement=Measurement.from_json(data["metrics"]) if data.get("metrics") else None,
            predicted_memory_bytes=data.get("predicted_memory_bytes"),
            measured_memory_bytes=data.get("measured_memory_bytes"),
            wall_time_s=data.get("wall_time_s", 0.0),
            error=data.get("error"),
            reason=Reason(data["reason"]) if data.get("reason") else None,
            model_info=ModelInfo.from_json(data["model_info"]) if data.get("model_info") else None,
            hosts=tuple(data.get("hosts", ())),
        )
