"""What the planned run costs at the pick and at the runner-up: device-hours (GPU-hours on CUDA,
process-hours on a CPU), and with `autotuning.cost_per_gpu_hour` the price. NeMo's auto-configurator
reports the time and GPU-hours of a run per configuration; DeepSpeed's autotuner reports neither.
Pure: from the results' measurements."""

from __future__ import annotations

import statistics
from typing import Sequence

from autotuner.tuning.space.planned_run import planned_run_s
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

PER_STEPS = 1000  # without planned steps, the cost of this many steps


def _device_hours(result: TrialResult, value: float, objective: Objective, steps: int,
                  planned: bool) -> tuple[float, float] | None:
    """(the run's wall seconds, its device-hours) at `steps` optimizer steps over the ranks it ran
    on: from the objective's value where it is a rate (throughput or latency, as the final pick
    compared it: its median where re-measured; one-off costs included over a planned run, added
    otherwise), else from the launch's steady step and one-off."""
    m = result.measurement
    if m is None or m.latency <= 0:
        return None
    one_off = 0.0 if planned else m.one_off_s()
    if objective.metric == "throughput" and value > 0 and m.train_batch_size:
        wall_s = steps * m.train_batch_size / value + one_off
    elif objective.metric == "latency" and value > 0:
        wall_s = steps * value + one_off
    else:
        wall_s = planned_run_s(m, steps)
    return wall_s, wall_s * max(1, m.world_size or 1) / 3600


def duration_text(seconds: float) -> str:
    """A run's wall time as the summary and the plan table write it: "2 h 05 min", "3.7 min", "10.3 s"."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _amount(value: float) -> str:
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def compared_values(results: list[TrialResult], remeasurements: Sequence[tuple[int, TrialResult]]) -> dict[str, float]:
    """Each result's value as the final pick compared it: the median of its measurements where it
    was re-measured, else its one."""
    found = {r.name: [r.value] for r in results if r.state is TrialState.OK and r.value is not None}
    for _round, again in remeasurements:
        if again.name in found and again.state is TrialState.OK and again.value is not None:
            found[again.name].append(again.value)
    return {name: statistics.median(values) for name, values in found.items()}


def _runner_up(results: list[TrialResult], pick: TrialResult, objective: Objective,
               values: dict[str, float]) -> TrialResult | None:
    best = None
    for result in results:
        if result.name in values and result.name != pick.name and (
                best is None or objective.better(values[result.name], values[best.name])):
            best = result
    return best


def cost_lines(results: list[TrialResult], pick: TrialResult | None, objective: Objective,
               planned_steps: int | None, price_per_hour: float | None, on_gpu: bool,
               remeasurements: Sequence[tuple[int, TrialResult]] = ()) -> list[str]:
    """One line each for the pick and the runner-up (by the values the final pick compared): the
    run's time and device-hours, and its price."""
    if pick is None or pick.value is None:
        return []
    values = {**compared_values(results, remeasurements), pick.name: pick.value}
    steps = planned_steps or PER_STEPS
    unit = "GPU-hours" if on_gpu else "device-hours (CPU processes)"
    span = f"the {steps} planned steps" if planned_steps else \
        f"{steps} steps (set autotuning.planned_steps for the run's own)"
    lines = []
    for role, result in (("pick", pick), ("runner-up", _runner_up(results, pick, objective, values))):
        cost = _device_hours(result, values[result.name], objective, steps, bool(planned_steps)) \
            if result is not None else None
        if cost is None:
            continue
        wall_s, hours = cost
        ranks = max(1, result.measurement.world_size or 1)
        line = f"run cost, {role} {result.name}: {span} in {duration_text(wall_s)} on {ranks} rank(s), {hours:.3g} {unit}"
        if price_per_hour is not None:
            line += f", {_amount(price_per_hour * hours)} at {price_per_hour:g} per hour (autotuning.cost_per_gpu_hour)"
        lines.append(line)
    return lines
