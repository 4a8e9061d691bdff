"""`--autotuning plan`'s outputs: the table printed, and `plan.csv`, one row per candidate at every
layout (searches/plan_search.py). Pure but for the one file written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tabulate import tabulate

from autotuner.tuning.reports.run_cost import PER_STEPS, duration_text
from autotuner.tuning.searches.plan_search import PlanRow
from autotuner.tuning.space.records import Objective

PLAN_FILE = "plan.csv"


@dataclass(frozen=True)
class PlanReport:
    """Every layout's rows, the predicted pick among them, and the lines the table is read with."""

    rows: tuple[PlanRow, ...]
    pick: PlanRow | None
    lines: tuple[str, ...]  # layouts left out, stages pruned, how the run's cost is counted
    objective: Objective
    planned_steps: int | None
    checkpointing: str  # the config's activation_checkpointing.policy, where a row's knobs do not set it
    price_per_device_hour: float | None = None


def planned_run(row: PlanRow, steps: int) -> tuple[float, float]:
    """(wall seconds, device-hours) of `steps` optimizer steps at the row's predicted step."""
    wall_s = steps * row.predicted_step_s
    return wall_s, wall_s * row.world_size / 3600


def csv_rows(report: PlanReport) -> list[dict[str, Any]]:
    steps = report.planned_steps or PER_STEPS
    found = []
    for row in report.rows:
        e = row.experiment
        knobs = dict(e.knobs)
        wall_s, device_hours = planned_run(row, steps)
        found.append({
            "name": e.name,
            "zero_stage": e.zero_stage,
            "tp": max(1, e.tensor_parallel),
            "pp": max(1, e.pipeline),
            "data_parallel_size": row.data_parallel_size,
            "micro_batch_size": e.micro_batch_size,
            "gradient_accumulation_steps": e.gradient_accumulation_steps,
            "train_batch_size": e.train_batch_size(row.data_parallel_size),
            "activation_checkpointing": knobs.pop("activation_checkpointing", report.checkpointing),
            "knobs": ";".join(f"{k}={v}" for k, v in sorted(knobs.items())),
            "fits": row.fits,
            "candidate": row.candidate,
            "picked": report.pick is not None and row is report.pick,
            "predicted_memory_bytes": row.predicted_memory_bytes,
            "predicted_step_s": _sig(row.predicted_step_s),
            "predicted_step_low_s": _sig(row.predicted_step_low_s),
            "predicted_step_high_s": _sig(row.predicted_step_high_s),
            "predicted_samples_per_s": _sig(row.predicted_samples_per_s),
            "predicted_metric": _sig(row.predicted_value),
            "metric_unit": report.objective.unit,
            "measured_step_s": _sig(row.measured_step_s) if row.measured_step_s else None,
            "planned_steps": steps,
            "planned_run_s": _sig(wall_s),
            "planned_device_hours": _sig(device_hours),
            "planned_cost": _sig(device_hours * report.price_per_device_hour) if report.price_per_device_hour else None,
            "left_out": row.left_out,
        })
    return found


def write_plan(results_dir: Path, report: PlanReport) -> Path:
    path = results_dir / PLAN_FILE
    pd.DataFrame(csv_rows(report)).to_csv(path, index=False)
    return path


def plan_text(report: PlanReport) -> str:
    """The printed table: every row, what it is predicted to hold and take, and why a row is out."""
    steps = report.planned_steps or PER_STEPS
    table = []
    for row in report.rows:
        wall_s, device_hours = planned_run(row, steps)
        mark = "*" if report.pick is not None and row is report.pick else ""
        table.append([mark + row.experiment.name, f"{row.predicted_memory_bytes / 2**20:.0f}",
                      "yes" if row.fits else "no", f"{row.predicted_step_s:.4g}",
                      f"{row.predicted_samples_per_s:.4g}", duration_text(wall_s), f"{device_hours:.3g}",
                      row.left_out or "candidate"])
    headers = ["name", "memory MiB/rank", "fits", "step s", "samples/s", f"{steps} steps", "device-h", "verdict"]
    lines = [tabulate(table, headers=headers, tablefmt="pipe"), *report.lines]
    if report.pick is not None:
        pick = report.pick
        low, high = (pick.experiment.train_batch_size(pick.data_parallel_size) / s
                     for s in (pick.predicted_step_high_s, pick.predicted_step_low_s))
        lines.append(f"plan: predicted pick {pick.experiment.name} (*): {pick.predicted_samples_per_s:.4g} samples/s "
                     f"(plausibly {low:.4g} to {high:.4g}), {pick.predicted_memory_bytes / 2**20:.0f} MiB a rank")
    else:
        lines.append("plan: no candidate fits; see each row's verdict")
    return "\n".join(lines) + "\n"


def _sig(value: float) -> float:
    return float(f"{value:.5g}")
