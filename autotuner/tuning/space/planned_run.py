"""The objective over the user's planned run, and what compiling costs and saves in it. Pure.

With `autotuning.planned_steps` (or the script's --max_steps) each experiment is scored by the
time to run the planned steps: its one-off costs (the steps before its window beyond as many
steady steps: compiling, above all) plus the planned steps at its steady step time. Throughput
becomes the planned samples over that time, latency that time per step; FLOPS stays steady.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotuner.core.boundary import Measurement
from autotuner.tuning.space import dimensions
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

FINISH_NOISE = 0.06  # twice the run-to-run spread of a step (cost_model.NOISE_FLOOR): a prediction's slack


def planned_run_s(measurement: Measurement, planned_steps: int) -> float:
    return measurement.one_off_s() + planned_steps * measurement.latency


def planned_value(measurement: Measurement, objective: Objective, planned_steps: int | None,
                  steady: float) -> float:
    """The objective's value over the planned run (`steady`, the window's own, without one)."""
    if not planned_steps or objective.metric == "FLOPS" or measurement.latency <= 0:
        return steady
    total_s = planned_run_s(measurement, planned_steps)
    if objective.metric == "latency":
        return total_s / planned_steps
    return planned_steps * (measurement.train_batch_size or steady * measurement.latency) / total_s


@dataclass(frozen=True)
class FinishEffect:
    """What finishing (compiling) did to one configuration measured both ways: its steady step
    time's ratio, the one-off it added, and the ratio of the objective's values (for results
    without measurements)."""

    step_ratio: float | None
    extra_one_off_s: float | None
    value_ratio: float

    @classmethod
    def measured(cls, finished: TrialResult, plain: TrialResult) -> "FinishEffect":
        f, p = finished.measurement, plain.measurement
        value_ratio = finished.value / plain.value if plain.value else 1.0
        if f is None or p is None or p.latency <= 0:
            return cls(None, None, value_ratio)
        return cls(f.latency / p.latency, f.one_off_s() - p.one_off_s(), value_ratio)


def predicted_finished_value(plain: TrialResult, effect: FinishEffect, objective: Objective,
                             planned_steps: int | None) -> float:
    """The objective's value `plain`'s configuration would reach finished, as `effect` says
    finishing changed another: its steady step scaled by the same ratio and, over a planned run,
    the same one-off added (compiling takes about as long whatever the micro-batch)."""
    m = plain.measurement
    if effect.step_ratio is None or m is None or m.latency <= 0 or not planned_steps or objective.metric == "FLOPS":
        return plain.value * effect.value_ratio
    latency = m.latency * effect.step_ratio
    total_s = max(0.0, m.one_off_s() + effect.extra_one_off_s) + planned_steps * latency
    if objective.metric == "latency":
        return total_s / planned_steps
    return planned_steps * (m.train_batch_size or m.throughput * m.latency) / total_s


def could_beat(predicted: float, incumbent: float, objective: Objective) -> bool:
    """Whether a prediction, given the slack of the measurements it rests on, could beat the best."""
    optimistic = predicted * (1 + FINISH_NOISE) if objective.maximize else predicted / (1 + FINISH_NOISE)
    return objective.better(optimistic, incumbent)


def _finished(result: TrialResult) -> dict:
    """The finishing dimensions (compile) the result ran at a value other than their neutral one."""
    return {name: value for name, value in result.experiment.knobs
            if name in dimensions.finishing_names() and value != dimensions.dimension(name).neutral_value()}


def _plain_twin(result: TrialResult, results: list[TrialResult]) -> TrialResult | None:
    """The same configuration measured without its finishing dimensions (eager, for compile)."""
    finishing = dimensions.finishing_names()
    knobs = {k: v for k, v in result.experiment.knobs if k not in finishing}
    for other in results:
        other_knobs = dict(other.experiment.knobs)
        if (other.state is TrialState.OK and not _finished(other)
                and {k: v for k, v in other_knobs.items() if k not in finishing} == knobs
                and other.experiment.zero_stage == result.experiment.zero_stage
                and other.experiment.micro_batch_size == result.experiment.micro_batch_size
                and other.experiment.gradient_accumulation_steps == result.experiment.gradient_accumulation_steps):
            return other
    return None


def compile_lines(results: list[TrialResult], planned_steps: int | None) -> list[str]:
    """For each finished configuration (compiled) measured beside its plain twin: its one-off
    cost, its steady step against the plain one's, and the step count from which it pays back."""
    lines = []
    for finished in results:
        if finished.state is not TrialState.OK or not (done := _finished(finished)):
            continue
        plain = _plain_twin(finished, results)
        if plain is None or finished.measurement is None or plain.measurement is None:
            continue
        c, e = finished.measurement, plain.measurement
        extra_s = c.one_off_s() - e.one_off_s()
        label = ", ".join(done)
        line = (f"{label}: {finished.name}: one-off {c.one_off_s():.1f} s (eager {e.one_off_s():.1f} s), steady step "
                f"{c.latency * 1e3:.1f} ms against {e.latency * 1e3:.1f} ms eager: ")
        if c.latency < e.latency:
            steps = max(0.0, extra_s) / (e.latency - c.latency)
            line += f"pays back after {steps:.0f} steps"
            if planned_steps:
                line += f" ({'within' if steps <= planned_steps else 'beyond'} the {planned_steps} planned)"
        else:
            line += "never pays back (no faster once compiled)"
        lines.append(line)
    return lines


def objective_line(planned_steps: int | None, from_config: bool, finishes_searched: bool) -> str | None:
    """What the run is scored by, said once before the search: the planned run's time, or a hint
    where compiling is tuned and only the steady metric scores it."""
    if planned_steps:
        source = "autotuning.planned_steps" if from_config else \
            "the script's --max_steps; autotuning.planned_steps overrides it"
        return (f"objective: the time to run the {planned_steps} planned steps ({source}), one-off costs such as "
                "compiling included")
    if finishes_searched:
        return ("objective: the steady metric, so compiling's one-off cost is not counted; set "
                "autotuning.planned_steps (or pass the script --max_steps) to score by the time to finish the run")
    return None
