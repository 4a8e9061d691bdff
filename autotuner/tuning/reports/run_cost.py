"""What the planned run costs at the pick and at the runner-up: device-hours (GPU-hours on CUDA,
process-hours on a CPU), and with `autotuning.cost_per_gpu_hour` the price. NeMo's auto-configurator
reports the time and GPU-hours of a run per configuration; DeepSpeed's autotuner reports neither.
Pure: from the results' measurements."""

from __future__ import annotations

from autotuner.tuning.space.planned_run import planned_run_s
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

PER_STEPS = 1000  # without planned steps, the cost of this many steps


def _device_hours(result: TrialResult, steps: int) -> tuple[float, float] | None:
    """(the run's wall seconds, its device-hours) at `steps` optimizer steps, from the launch's
    steady step time and one-off costs, over the ranks it ran on."""
    m = result.measurement
    if m is None or m.latency <= 0:
        return None
    wall_s = planned_run_s(m, steps)
    return wall_s, wall_s * max(1, m.world_size or 1) / 3600


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _amount(value: float) -> str:
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _runner_up(results: list[TrialResult], pick: TrialResult, objective: Objective) -> TrialResult | None:
    others = [r for r in results if r.state is TrialState.OK and r.value is not None and r.name != pick.name]
    return objective.best(others)


def cost_lines(results: list[TrialResult], pick: TrialResult | None, objective: Objective,
               planned_steps: int | None, price_per_hour: float | None, on_gpu: bool) -> list[str]:
    """One line each for the pick and the runner-up: the run's time and device-hours (and price)."""
    if pick is None:
        return []
    steps = planned_steps or PER_STEPS
    unit = "GPU-hours" if on_gpu else "device-hours (CPU processes)"
    span = f"the {steps} planned steps" if planned_steps else \
        f"{steps} steps (set autotuning.planned_steps for the run's own)"
    lines = []
    for role, result in (("pick", pick), ("runner-up", _runner_up(results, pick, objective))):
        cost = _device_hours(result, steps) if result is not None else None
        if cost is None:
            continue
        wall_s, hours = cost
        ranks = max(1, result.measurement.world_size or 1)
        line = f"run cost, {role} {result.name}: {span} in {_duration(wall_s)} on {ranks} rank(s), {hours:.3g} {unit}"
        if price_per_hour is not None:
            line += f", {_amount(price_per_hour * hours)} at {price_per_hour:g} per hour (autotuning.cost_per_gpu_hour)"
        lines.append(line)
    return lines
