"""What a tuning run leaves behind once the search is over: the optimal config and commands, the
summary table and its explanation. Reads the search's record; writes files; launches nothing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from autotuner.core.engine_kind import Engine
from autotuner.config.tuned_values import TUNED_VALUES_FILE
from autotuner.core.boundary import TunedValues, write_record
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.trials.runner import Placement
from autotuner.tuning.trials.trial import ExperimentSettings, picked_config, script_config
from autotuner.tuning.reports.optimal_commands import (deepspeed_command, optimal_command,
                                                      optimal_script_args)
from autotuner.tuning.memory.varying_batches import varying_batch_lines
from autotuner.core.noise_scale import NoiseScale
from autotuner.tuning.reports.batch_ramp_plan import write_plan
from autotuner.tuning.reports.goodput import goodput_lines, scale_learning_rate
from autotuner.tuning.space.planned_run import compile_lines
from autotuner.tuning.searches.predictive_search import PredictiveOutcome
from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.reports.run_cost import cost_lines
from autotuner.tuning.reports.results import Explanation, PredictedPoint, write_results


@dataclass(frozen=True)
class TuningOutcome:
    results: tuple[TrialResult, ...]
    best: TrialResult | None
    summary: str
    optimal_config_path: Path | None
    optimal_script_args: tuple[str, ...] | None
    optimal_command: tuple[str, ...] | None
    deepspeed_command: tuple[str, ...] | None = None  # the same training with DeepSpeed's own launcher
    # The pick's TunedValues file, where the script builds its config in code and our engine laid the
    # tuned values over it: the optimal command names it (--tuned_values), as `run`'s training does.
    tuned_values_path: Path | None = None


@dataclass(frozen=True)
class SearchRecord:
    """What the profile, the search and the final pick produced."""

    launched: tuple[TrialResult, ...]  # one per experiment, the profile launches included
    pruned: tuple[TrialResult, ...]
    profile_names: frozenset[str]
    best: TrialResult | None  # with its re-measured median as value
    remeasurements: tuple[tuple[int, TrialResult], ...]  # (round, result): the final pick's
    lines: tuple[str, ...]  # for the summary: the transfer prior's, then the final pick's
    predictions: PredictiveOutcome | None  # what tuner_type "predictive" predicted
    elapsed_s: float
    noise_scale: NoiseScale | None = None  # metric goodput: B_noise as the profile measured it
    critical_batch: int | None = None  # metric goodput: the config's critical_batch_size, used in its place
    layout_lines: tuple[str, ...] = ()  # the layouts: fixed, or each searched, kept or not
    price_per_hour: float | None = None  # autotuning.cost_per_gpu_hour
    ramp: tuple[int, int | None] | None = None  # adapt_batch: (adapt_interval, max_train_batch_size)
    launches: int | None = None  # every launch this run made (the ledger's count)
    repeats: int = 0  # of them, launched again after interference disturbed the window


def write_outcome(record: SearchRecord, settings: ExperimentSettings, objective: Objective, results_dir: Path,
                  on_gpu: bool, placement: Placement = Placement()) -> TuningOutcome:
    best = record.best
    optimal_path = optimal_args = optimal_cmd = config = deepspeed_cmd = None
    goodput = goodput_lines(list(record.launched), objective, record.noise_scale, settings.data_parallel_size,
                            record.critical_batch, pick=best)
    tuned_path = None
    if best is not None:
        tuned = pick_tuned_values(best.experiment, record.launched, settings.base_config)
        if tuned is not None:  # written before the command that names it
            tuned_path = (results_dir / TUNED_VALUES_FILE).resolve()
            write_record(tuned_path, tuned)
        config = picked_config(best.experiment, settings)
        if objective.reference_batch:  # metric goodput (also where it fell back to throughput)
            config, script_args, line = scale_learning_rate(
                config, settings.script_args, best.experiment.train_batch_size(settings.data_parallel_size),
                objective.reference_batch, settings.lr_scaling, trainer=settings.trainer)
            settings = replace(settings, script_args=script_args)
            goodput.append(line)
            if record.ramp is not None:  # the training run grows the batch: its plan, and the config's section
                config["autotuning"] = write_plan(list(record.launched), best, objective, settings.lr_scaling,
                                                  *record.ramp, results_dir)
                goodput.append(f"batch ramp: the training run reads B_noise and may grow gradient accumulation every "
                               f"{record.ramp[0]} steps from global batch "
                               f"{best.experiment.train_batch_size(settings.data_parallel_size)} "
                               f"({results_dir / 'batch_ramp.json'}; each change a row of batch_ramp.csv)")
        optimal_path = (results_dir / "ds_config_optimal.json").resolve()
        optimal_args = optimal_script_args(settings, config, optimal_path)
        optimal_cmd = optimal_command(settings, optimal_args, tuned_path, placement)
        if settings.engine == Engine.DEEPSPEED:
            deepspeed_cmd = deepspeed_command(settings, optimal_args, on_gpu, placement=placement)
            if deepspeed_cmd is not None and record.ramp is not None:
                goodput.append("batch ramp: the ranks this launcher starts run it; under DeepSpeed's launcher the "
                               "script trains at the optimal config's batch throughout")
        config = script_config(config, settings.engine)  # what the mapped flags carry stays out
    if tuned_path is None:
        (results_dir / TUNED_VALUES_FILE).unlink(missing_ok=True)  # an earlier tune's, for another pick
    compiled = list(record.layout_lines) + compile_lines(list(record.launched), settings.planned_steps)
    compiled += cost_lines(list(record.launched), best, objective, settings.planned_steps, record.price_per_hour,
                           on_gpu, record.remeasurements)
    compiled += goodput
    compiled += varying_batch_lines([r.measurement for r in record.launched if r.measurement is not None],
                                    settings.max_sequence_length, settings.max_sequence_length_from)
    # (These lines are the summary's, which is printed once at the end: not reported here as well.)
    explanation = Explanation(record.profile_names, record.remeasurements, tuple(compiled) + record.lines,
                              *predicted_points(record.predictions), chosen=best, launches=record.launches,
                              repeats=record.repeats)
    everything = record.launched + record.pruned
    summary = write_results(results_dir, list(everything), objective, record.elapsed_s, config,
                            list(optimal_cmd) if optimal_cmd else None, explanation,
                            list(deepspeed_cmd) if deepspeed_cmd else None)
    return TuningOutcome(everything, best, summary, optimal_path, optimal_args, optimal_cmd, deepspeed_cmd,
                         tuned_path)


def pick_tuned_values(pick: Experiment, launched: tuple[TrialResult, ...],
                      base_config: dict | None = None) -> TunedValues | None:
    """The pick's tuned values, where a launch's ranks laid tuned values over the script's own config
    (it builds its config in code, so the optimal config file alone would not reach it); else None."""
    if not any(r.measurement is not None and r.measurement.tuned_over_script for r in launched):
        return None
    return TunedValues(pick.tuned_values_in(base_config or {}))


def predicted_points(predictions: PredictiveOutcome | None) -> tuple[tuple[PredictedPoint, ...],
                                                                     tuple[PredictedPoint, ...]]:
    """The predictive tuner's predictions, at each launch and at the end, for the summary."""
    if predictions is None:
        return (), ()

    def point(candidate) -> PredictedPoint:
        e, p = candidate.experiment, candidate.prediction
        return PredictedPoint(e.name, e.zero_stage, e.micro_batch_size, p.value, p.low, p.high,
                              candidate.launched, candidate.ruled_out_by, candidate.why)

    return (tuple(point(c) for c in predictions.at_launch), tuple(point(c) for c in predictions.final))
