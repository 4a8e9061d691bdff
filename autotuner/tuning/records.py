"""Trial outcomes: a state enum and an immutable result record. Failures are recorded, never raised."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from autotuner.tuning.space import Experiment


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


METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "FLOPS": "FLOPS_per_gpu"}


@dataclass(frozen=True)
class Objective:
    """Which metric decides, and whether larger is better (latency is minimised)."""

    metric: Literal["throughput", "latency", "FLOPS"] = "throughput"

    @property
    def key(self) -> str:
        return METRIC_KEYS[self.metric]

    @property
    def unit(self) -> str:
        return {"throughput": "samples/s", "latency": "s per step", "FLOPS": "FLOP/s per rank"}[self.metric]

    @property
    def maximize(self) -> bool:
        return self.metric != "latency"

    def better(self, candidate: float, incumbent: float | None) -> bool:
        if incumbent is None:
            return True
        return candidate > incumbent if self.maximize else candidate < incumbent

    def best(self, results: list["TrialResult"]) -> "TrialResult | None":
        ok = [r for r in results if r.state is TrialState.OK and r.value is not None]
        if not ok:
            return None
        return max(ok, key=lambda r: r.value) if self.maximize else min(ok, key=lambda r: r.value)


@dataclass(frozen=True)
class TrialResult:
    """What one experiment gave. `value` is the objective's metric; None unless state is OK."""

    experiment: Experiment
    state: TrialState
    value: float | None = None
    value_std: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    predicted_memory_bytes: int | None = None
    measured_memory_bytes: int | None = None
    wall_time_s: float = 0.0
    error: str | None = None

    @property
    def name(self) -> str:
        return self.experiment.name

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        data["name"] = self.name
        data["experiment"]["knobs"] = [list(kv) for kv in self.experiment.knobs]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrialResult":
        exp = data["experiment"]
        experiment = Experiment(exp["zero_stage"], exp["micro_batch_size"], exp["gradient_accumulation_steps"],
                                tuple((k, v) for k, v in exp.get("knobs", [])))
        return cls(
            experiment=experiment,
            state=TrialState(data["state"]),
            value=data.get("value"),
            value_std=data.get("value_std"),
            metrics=data.get("metrics") or {},
            predicted_memory_bytes=data.get("predicted_memory_bytes"),
            measured_memory_bytes=data.get("measured_memory_bytes"),
            wall_time_s=data.get("wall_time_s", 0.0),
            error=data.get("error"),
        )
