"""Writing results: summary table, experiments.csv, optimal config and command, plot."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from autotuner.core.engine_kind import Engine
from autotuner.core.atomic import write_json_atomic
from autotuner.core.boundary import ModelInfo, Summary
from autotuner.tuning.space.records import Objective, Reason, TrialResult, TrialState


@dataclass(frozen=True)
class PredictedPoint:
    """A throughput-model prediction for one experiment (objective's units)."""

    name: str
    zero_stage: int
    micro_batch_size: int
    value: float
    low: float
    high: float
    launched: bool = True
    ruled_out_by: Reason | None = None  # when never launched
    why: str = ""  # why it was launched


@dataclass(frozen=True)
class Explanation:
    """Why the pick is what it is: which launches were profile launches, the final re-measurements
    and their verdict, the predictions each launch was made on, and the model's final curves."""

    profile_names: frozenset[str] = frozenset()
    remeasurements: tuple[tuple[int, TrialResult], ...] = ()  # (round, result)
    final_pick_lines: tuple[str, ...] = ()
    at_launch: tuple[PredictedPoint, ...] = ()
    curves: tuple[PredictedPoint, ...] = ()
    chosen: TrialResult | None = None  # the pick (its value: the median when re-measured); else the best
    launches: int | None = None  # every launch of this run (the ledger's: repeats after interference included)
    repeats: int = 0  # of them, launched again because another process disturbed the window


def _format_duration(seconds: float) -> str:
    """H:MM:SS.ss, as DeepSpeed prints it."""
    minutes, secs = divmod(round(seconds, 2), 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{secs:05.2f}"


def value_kind(result: TrialResult | None, explanation: Explanation) -> str:
    """What a row's value is: the pick's median of its runs where the final pick re-measured it,
    else the single run the search measured."""
    if result is None:
        return ""
    runs = 1 + sum(1 for _, r in explanation.remeasurements
                   if r.experiment == result.experiment and r.state is TrialState.OK)
    remeasured = explanation.chosen is not None and result.experiment == explanation.chosen.experiment and runs > 1
    return f"median of {runs} runs" if remeasured else "single run"


def summary_text(results: list[TrialResult], objective: Objective, wall_time_s: float,
                 explanation: Explanation = Explanation()) -> str:
    """One row per tuning space (z0..z3) and a global row, as DeepSpeed prints, each naming what
    its value is (a single run, or the pick's median of re-measured runs)."""
    launched = [r for r in results if r.state is not TrialState.PRUNED]
    chosen = explanation.chosen
    rows = []
    for stage in sorted({r.experiment.zero_stage for r in launched}):
        in_space = [r for r in launched if r.experiment.zero_stage == stage]
        best = objective.best(in_space)
        if chosen is not None and chosen.experiment.zero_stage == stage:
            best = chosen  # its stage's row agrees with the global one, and says it holds a median
        rows.append([f"z{stage}", len(in_space), _value(best), value_kind(best, explanation),
                     best.name if best else None])
    best = explanation.chosen or objective.best(launched)
    rows.append(["global", len(launched), _value(best), value_kind(best, explanation), best.name if best else None])
    table = tabulate(rows, headers=["tuning_space", "num_experiments", f"best_metric_val ({objective.unit})",
                                       "value_of", "best_exp_name"],
                     tablefmt="pipe")
    launches = (explanation.launches if explanation.launches is not None
                else len(launched) + len(explanation.remeasurements))
    footer = f"Tuning completed in {_format_duration(wall_time_s)}. Total number of experiments: {len(launched)}."
    if explanation.remeasurements or explanation.profile_names or explanation.repeats:
        repeats = f", {explanation.repeats} launched again after interference" if explanation.repeats else ""
        footer += (f" Launches: {launches} ({len(explanation.profile_names)} of them profile launches, "
                   f"{len(explanation.remeasurements)} re-measurements{repeats}).")
    lines = [footer, *engine_lines(launched), *several_engines_lines(launched), *memory_lines(launched),
             *prediction_lines(explanation),
             *explanation.final_pick_lines]
    return f"{table}\n" + "\n".join(lines) + "\n"


def engine_lines(results: list[TrialResult]) -> list[str]:
    """Whose engine the measured launches ran on, when it was DeepSpeed's (the records say so)."""
    measured = [r.measurement.engine for r in results if r.measurement is not None]
    on_deepspeed = measured.count(Engine.DEEPSPEED)
    if not on_deepspeed:
        return []
    return [f"Engine: DeepSpeed's own (DeepSpeedEngine) ran {on_deepspeed} of {len(measured)} measured launches; "
            "the figures are our end-to-end timers around it, not DeepSpeed's timer sum."]


def measured_engine(info: ModelInfo) -> str:
    """Which of a script's engines the tune measured and tuned (DeepSpeed-Chat's step 3 builds four)."""
    model = f" ({info.measured_model})" if info.measured_model else ""
    if info.engine == Engine.OURS:
        return (f"the tuned values are for the first it built with an optimizer{model}, and are laid over that "
                "engine's config only; the others train with their own, as each DeepSpeed engine keeps the config "
                "it was given; the profile measures only that engine")
    return f"the profile measures only the first it built{model}"


def several_engines_lines(results: list[TrialResult]) -> list[str]:
    """Where the script built several engines: which one the values were tuned for."""
    infos = [r.model_info for r in results if r.model_info is not None and r.model_info.engines_in_process > 1]
    if not infos:
        return []
    return [f"Engines: the script made {infos[0].engines_in_process}; {measured_engine(infos[0])}."]


def memory_lines(results: list[TrialResult]) -> list[str]:
    """The memory model's error over the launches it predicted (before each ran)."""
    pairs = [(r.predicted_memory_bytes, r.measured_memory_bytes) for r in results
             if r.predicted_memory_bytes and r.measured_memory_bytes]
    if not pairs:
        return []
    errors = [100.0 * (p - m) / m for p, m in pairs]
    return [f"Memory model, predicted before each launch: error {min(errors):+.1f}% to {max(errors):+.1f}% over "
            f"{len(pairs)} launches (experiments.csv: predicted_memory_mib, measured_memory_mib)."]


def prediction_lines(explanation: Explanation) -> list[str]:
    if not explanation.curves:
        return []
    by_prediction = [p.name for p in explanation.curves if p.ruled_out_by is Reason.PREDICTION]
    by_memory = [p.name for p in explanation.curves if p.ruled_out_by is Reason.MEMORY_REFITTED]
    line = (f"Throughput model: {len(explanation.curves)} candidates; prediction ruled out {len(by_prediction)} "
            f"without launching them")
    if by_memory:
        line += f", the refitted memory model {len(by_memory)}"
    why = [f"  {p.name}: {p.why}" for p in explanation.at_launch if p.why]
    return [line + ("" if not by_prediction else f" ({', '.join(by_prediction)})") + ".",
            *(["Why each searched launch ran (experiments.csv: why_launched):", *why] if why else [])]


def _value(result: TrialResult | None) -> float | None:
    return round(result.value, 4) if result is not None and result.value is not None else None


def result_rows(results: list[TrialResult], objective: Objective,
                explanation: Explanation = Explanation()) -> list[dict[str, Any]]:
    predicted = {p.name: p for p in explanation.at_launch}
    runs = [(r, "profile" if r.name in explanation.profile_names else "search", 0) for r in results]
    runs += [(r, "remeasure", round_index) for round_index, r in explanation.remeasurements]
    rows = []
    for r, phase, round_index in runs:
        m = r.measurement
        prediction = predicted.get(r.name) if phase == "search" else None
        rows.append({
            "name": r.name,
            "chosen": phase != "remeasure" and explanation.chosen is not None and r.name == explanation.chosen.name,
            "phase": phase,
            "run": round_index,
            "state": r.state.value,
            "engine": m.engine if m else None,  # whose engine measured it: "autotuner" or "deepspeed"
            "zero_stage": r.experiment.zero_stage,
            "tp": r.experiment.tensor_parallel or None,  # the tensor-parallel degree the tune set
            "pp": r.experiment.pipeline or None,  # the pipeline stages the tune set
            "stages_per_rank": r.experiment.stages_per_rank or None,  # its virtual stages per pipeline rank
            "micro_batch_size": r.experiment.micro_batch_size,
            "gradient_accumulation_steps": r.experiment.gradient_accumulation_steps,
            "knobs": ";".join(f"{k}={v}" for k, v in r.experiment.knobs),
            "metric": objective.metric,
            "metric_value": r.value,
            "metric_unit": objective.unit,
            "metric_std": r.value_std,
            "predicted_metric": _round(prediction.value) if prediction else None,
            "predicted_metric_low": _round(prediction.low) if prediction else None,
            "predicted_metric_high": _round(prediction.high) if prediction else None,
            "why_launched": _why(phase, prediction),
            "throughput_samples_s": m.throughput if m else None,
            "latency_s": m.latency if m else None,
            "forward_ms": _ms(m.forward if m else None),
            "backward_ms": _ms(m.backward if m else None),
            "step_ms": _ms(m.step if m else None),
            "window_steps": m.step_wall_s.count if m and m.step_wall_s else None,
            "window_s": round(m.step_wall_s.mean_s * m.step_wall_s.count, 3) if m and m.step_wall_s else None,
            "cpu_taken_by_others": m.cpu_taken_by_others if m else None,  # share of the node's CPUs, in the window
            "load_average": m.load_average if m else None,
            "predicted_memory_mib": _mib(r.predicted_memory_bytes),
            "measured_memory_mib": _mib(r.measured_memory_bytes),
            "memory_error_pct": _error_pct(r.predicted_memory_bytes, r.measured_memory_bytes),
            "wall_time_s": round(r.wall_time_s, 2),
            "hosts": " ".join(r.hosts),
            "error": r.error,
        })
    for column in ("tp", "pp"):  # a column of a layout search's (or a fixed degree's)
        if not any(row[column] for row in rows):
            for row in rows:
                del row[column]
    return rows


def _why(phase: str, prediction: PredictedPoint | None) -> str:
    if phase == "profile":
        return "profile: fits the memory and step-time models"
    if phase == "remeasure":
        return "re-measured for the final pick"
    return prediction.why if prediction is not None and prediction.why else "the tuner's next candidate"


def _round(value: float) -> float:
    return float(f"{value:.5g}")


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
                  optimal_config: dict[str, Any] | None, optimal_cmd: list[str] | None,
                  explanation: Explanation = Explanation(), deepspeed_cmd: list[str] | None = None) -> str:
    """Write every output file; returns the summary text."""
    import pandas as pd

    results_dir.mkdir(parents=True, exist_ok=True)
    summary = summary_text(results, objective, wall_time_s, explanation)
    (results_dir / "summary.txt").write_text(summary)
    pd.DataFrame(result_rows(results, objective, explanation)).to_csv(results_dir / "experiments.csv", index=False)
    if optimal_config is not None and optimal_cmd is not None:
        write_json_atomic(results_dir / "ds_config_optimal.json", optimal_config)
        (results_dir / "cmd_optimal.txt").write_text(optimal_command(optimal_cmd) + "\n")
    if deepspeed_cmd is not None:
        (results_dir / "cmd_optimal_deepspeed.txt").write_text(optimal_command(deepspeed_cmd) + "\n")
    else:
        (results_dir / "cmd_optimal_deepspeed.txt").unlink(missing_ok=True)
    if optimal_config is None or optimal_cmd is None:
        for stale in ("ds_config_optimal.json", "cmd_optimal.txt"):
            (results_dir / stale).unlink(missing_ok=True)
    plot_metric(results_dir / "metric_vs_micro_batch.png", results, objective, explanation.curves)
    return summary


def plot_metric(path: Path, results: list[TrialResult], objective: Objective,
                curves: tuple[PredictedPoint, ...] = ()) -> bool:
    """The metric against micro-batch size per stage, if matplotlib is installed: measured points,
    and the throughput model's predicted curve with its plausible band (tuner_type predictive)."""
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
    for index, stage in enumerate(sorted({r.experiment.zero_stage for r in ok} | {c.zero_stage for c in curves})):
        colour = f"C{index}"
        points = sorted((r.experiment.micro_batch_size, r.value) for r in ok if r.experiment.zero_stage == stage)
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", linestyle="none", color=colour,
                      label=f"ZeRO {stage} measured")
        curve = sorted((c.micro_batch_size, c.value, c.low, c.high) for c in curves if c.zero_stage == stage)
        if curve:
            sizes = [c[0] for c in curve]
            axes.plot(sizes, [c[1] for c in curve], color=colour, linestyle="--", label=f"ZeRO {stage} predicted")
            axes.fill_between(sizes, [c[2] for c in curve], [c[3] for c in curve], color=colour, alpha=0.15)
        elif points:
            axes.plot([p[0] for p in points], [p[1] for p in points], color=colour)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("micro-batch size per rank")
    axes.set_ylabel(objective.unit)
    axes.set_title(f"{objective.metric} by micro-batch size")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
