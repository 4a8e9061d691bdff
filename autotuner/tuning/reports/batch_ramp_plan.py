"""The batch ramp's plan for the pick's training run (autotuning.adapt_batch; the ramp itself is
runtime/training/batch_ramp.py): the step costs the tune measured at the pick's configuration,
written beside the optimal config, and the `autotuning` section that config gets so its ranks
read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotuner.core.atomic import write_json_atomic
from autotuner.runtime.training.batch_ramp import LAST_FILE, RampPlan, StepCost
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

PLAN_FILE = "batch_ramp.json"
CSV_FILE = "batch_ramp.csv"  # the ramp's rows, beside the online tuner's


def step_costs(results: list[TrialResult], pick: TrialResult) -> tuple[StepCost, ...]:
    """Per micro-batch size, from the launches at the pick's stage, dimensions and layout: the
    optimizer step as the engine timed it (what a larger accumulation count amortises), and the rest
    of a step's wall time spread over its micro-steps. Work a script does once a step outside the
    engine then counts per micro-step: the ramp's gain from a larger count is never overstated."""
    costs: dict[int, StepCost] = {}
    for result in results:
        e, m = result.experiment, result.measurement
        same = (e.zero_stage, e.knobs, e.layout) == (pick.experiment.zero_stage, pick.experiment.knobs,
                                                     pick.experiment.layout)
        if not same or result.state is not TrialState.OK or m is None or m.latency <= 0:
            continue
        gas = e.gradient_accumulation_steps
        step_s = min(m.step.mean_s, m.latency) if m.step is not None else 0.0
        costs[e.micro_batch_size] = StepCost(e.micro_batch_size, (m.latency - step_s) / gas, step_s)
    return tuple(costs[size] for size in sorted(costs))


def write_plan(results: list[TrialResult], pick: TrialResult, objective: Objective, lr_scaling: str, interval: int,
               max_global_batch: int | None, results_dir: Path) -> dict[str, Any]:
    """Write the plan; returns the `autotuning` section for the optimal config."""
    plan = RampPlan(int(objective.reference_batch), lr_scaling, interval, step_costs(results, pick),
                    max_global_batch, str((results_dir / CSV_FILE).resolve()), objective.noise_scale)
    path = (results_dir / PLAN_FILE).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, plan.to_json())
    for stale in (results_dir / CSV_FILE, results_dir / LAST_FILE):  # a new pick's ramp starts its own
        if stale.exists():
            stale.unlink()
    return {"adapt_batch": True, "adapt_interval": interval, "metric": "goodput",
            "reference_batch_size": int(objective.reference_batch), "lr_scaling": lr_scaling, "adapt_plan": str(path)}


def ramp_lines(results_dir: Path) -> list[str]:
    """What the training run's ramp did, from its CSV: the first and last global batch and the
    steps at which it changed (nothing where the run kept no ramp)."""
    import csv

    path = results_dir / CSV_FILE
    if not path.exists():
        return []
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return []
    changes = rows[1:]
    first, last = rows[0], rows[-1]
    if not changes:
        return [f"batch ramp: the global batch stayed {first['global_batch']} (B_noise never asked for a larger one "
                f"worth the change; {path})"]
    steps = ", ".join(f"step {row['step']}: {row['global_batch']}" for row in changes)
    return [f"batch ramp: global batch {first['global_batch']} -> {last['global_batch']} ({steps}; B_noise "
            f"{last['b_noise'] or 'not read'} at the last change; {path})"]


def late_noise(results_dir: Path) -> dict | None:
    """The training run's last own B_noise (runtime/training/batch_ramp.py's LAST_FILE), or None."""
    import json

    path = results_dir / LAST_FILE
    try:
        late = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return late if isinstance(late.get("b_noise"), (int, float)) and late["b_noise"] > 0 else None
