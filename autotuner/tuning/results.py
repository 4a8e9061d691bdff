"""Writing results: summary table, experiments.csv, optimal config and command, plot."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tabulate import tabulate

from autotuner.atomic import write_json_atomic
from autotuner.boundary import Summary
from autotuner.tuning.records import Objective, TrialResult, TrialState


def _format_duration(seconds: float) -> str:
    """H:MM:SS.ss, as DeepSpeed prints it."""
    minutes, secs = divmod(round(seconds, 2), 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{secs:05.2f}"


def summary_text(results: list[TrialResult], objective: Objective, wall_time_s: float) -> str:
    """One row per tuning space (z0..z3) and a global row, as DeepSpeed prints."""
    launched = [r for r in results if r.state is not TrialState.PRUNED]
    rows = []
    for stage in sorted({r.experiment.zero_stage for r in launched}):
        in_space = [r for r in launched if r.experiment.zero_stage == stage]
        best = objective.best(in_space)
        rows.append([f"z{stage}", len(in_space), _value(best), best.name if best else None])
    best = objective.best(launched)
    rows.append(["global", len(launched), _value(best), best.name if best else None])
    table = tabulate(rows, headers=["tuning_space", "num_experiments", f"best_metric_val ({objective.unit})",
                                       "best_exp_name"],
                     tablefmt="pipe")
    footer = f"Tuning completed in {_format_duration(wall_time_s)}. Total number of experiments: {len(launched)}."
    return f"{table}\n{footer}\n"


def _value(result: TrialResult | None) -> float | None:
    return round(result.value, 4) if result is not None and result.value is not None else None


def result_rows(results: list[TrialResult], objective: Objective) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        m = r.measurement
        rows.append({
            "name": r.name,
            "state": r.state.value,
            "zero_stage": r.experiment.zero_stage,
            "micro_batch_size": r.experiment.micro_batch_size,
            "gradient_accumulation_steps": r.experiment.gradient_accumulation_steps,
            "knobs": ";".join(f"{k}={v}" for k, v in r.experiment.knobs),
            "metric": objective.metric,
            "metric_value": r.value,
            "metric_unit": objective.unit,
            "metric_std": r.value_std,
            "throughput_samples_s": m.throughput if m else None,
            "latency_s": m.latency if m else None,
            "forward_ms": _ms(m.forward if m else None),
            "backward_ms": _ms(m.backward if m else None),
            "step_ms": _ms(m.step if m else None),
            "predicted_memory_mib": _mib(r.predicted_memory_bytes),
            "measured_memory_mib": _mib(r.measured_memory_bytes),
            "memory_error_pct": _error_pct(r.predicted_memory_bytes, r.measured_memory_bytes),
            "wall_time_s": round(r.wall_time_s, 2),
            "error": r.error,
        })
    return rows


def _ms(timer: Summary | None) -> float | None:
    return round(timer.mean_s * 1e3, 3) if timer else None


def _mib(value: int | None) -> float | None:
    return round(value / 2**20, 1) if value else None


def _error_pct(predicted: int | None, measured: int | None) -> float | None:
    if not predicted or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 1)


def optimal_command(command: list[str]) -> str:
    """A shell-quoted command line a user can paste."""
    return shlex.join(command)


def write_results(results_dir: Path, results: list[TrialResult], objective: Objective, wall_time_s: float,
                  optimal_config: dict[str, Any] | None, optimal_cmd: list[str] | None) -> str:
    """Write every output file; returns the summary text."""
    import pandas as pd

    results_dir.mkdir(parents=True, exist_ok=True)
    summary = summary_text(results, objective, wall_time_s)
    (results_dir / "summary.txt").write_text(summary)
    pd.DataFrame(result_rows(results, objective)).to_csv(results_dir / "experiments.csv", index=False)
    if optimal_config is not None and optimal_cmd is not None:
        write_json_atomic(results_dir / "ds_config_optimal.json", optimal_config)
        (results_dir / "cmd_optimal.txt").write_text(optimal_command(optimal_cmd) + "\n")
    else:
        for stale in ("ds_config_optimal.json", "cmd_optimal.txt"):
            (results_dir / stale).unlink(missing_ok=True)
    plot_metric(results_dir / "metric_vs_micro_batch.png", results, objective)
    return summary


def plot_metric(path: Path, results: list[TrialResult], objective: Objective) -> bool:
    """The metric against micro-batch size per stage, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r.state is TrialState.OK and not r.experiment.knobs]
    if not ok:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for stage in sorted({r.experiment.zero_stage for r in ok}):
        points = sorted((r.experiment.micro_batch_size, r.value) for r in ok if r.experiment.zero_stage == stage)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"ZeRO {stage}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("micro-batch size per rank")
    axes.set_ylabel({"throughput": "samples/s", "latency": "s per step", "FLOPS": "FLOP/s per rank"}[objective.metric])
    axes.set_title(f"{objective.metric} by micro-batch size")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
