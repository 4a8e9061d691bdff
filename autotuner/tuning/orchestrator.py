"""The one orchestrator: profile -> memory model -> search (ask/run/tell) -> results."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from autotuner.core.atomic import sweep_partial_writes
from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.space.config_space import engine_dimensions, untuned_offload_lines
from autotuner.tuning.space.devices import DeviceFacts
from autotuner.tuning.tuners import tuner_spec
from autotuner.tuning.tuners.predictive import pooled_rule
from autotuner.tuning.trials.trial import ExperimentSettings, Trial, rescored
from autotuner.tuning.trials.evaluator import Evaluator, RunnerLaunches, TuningFailed
from autotuner.tuning.trials.history import HISTORY_FILE, make_history
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.trials.ledger import TrialLedger
from autotuner.tuning.models import gradient_noise
from autotuner.tuning.models.comm_fit import fit_collectives
from autotuner.tuning.models.cost_model import NOISE_FLOOR, CostContext
from autotuner.tuning.memory.estimate import COMPUTE_BYTES, ModelProfile
from autotuner.tuning.models.memory_book import MemoryBook
from autotuner.tuning.searches.predictive_search import PredictiveOutcome, run_predictive_search
from autotuner.tuning.profiling import profile_from_config, profile_lines, profile_model
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.searches.final_pick import final_pick_rounds
from autotuner.tuning.reports.outcome import SearchRecord, TuningOutcome, write_outcome
from autotuner.tuning.trials.runner import Runner
from autotuner.launch.stopping import mark_work_started
from autotuner.tuning.space.planned_run import objective_line
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.searches.variant_rules import checkpointing_settled, variant_text
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace, ladder_sizes
from autotuner.tuning.models.sharding_gain import REASON_PREFIX, sharding_cannot_win
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.trials.similar_runs import SimilarRuns
from autotuner.tuning.models.transfer import TransferPrior
from autotuner.tuning.trials.trial_store import HistoryStore, JournalStore


# The first profile launch's largest gas: each accumulation step is a whole forward/backward pass.
PROFILE_MAX_GAS = 8


def follow_the_launch(built: str) -> str:
    """The default for a script whose engine the command line did not settle: the launch's."""
    return f"engine: the profile launch's ranks built {built}'s engine; every experiment runs there"


class Autotuner:
    """Runs one tuning job. `report` receives progress lines. `settle_engine` is given the engine
    the profile launch's ranks built when the settings had not settled it (or expected the other):
    it refuses what is wrong for that engine (raising a ConfigError), else returns the line to
    report, saying which engine and why."""

    def __init__(self, config: DeepSpeedConfig, settings: ExperimentSettings, results_dir: Path, exps_dir: Path,
                 runner: Runner, fingerprint: Fingerprint, report: Callable[[str], None] = print,
                 settle_engine: Callable[[str], str] = follow_the_launch, *, devices: DeviceFacts,
                 space: SearchSpace):
        """`devices` and `space`: the settle pass's (app/settle.py), read and built once there."""
        self.config = config
        self.settle_engine = settle_engine
        self.settings = settings
        self.runner = runner
        self.fingerprint = fingerprint
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.report = report
        self.objective = settings.objective
        tuning = config.autotuning
        self.policy = SearchPolicy.from_tuning(self.objective, tuning, settings.planned_steps)
        self.devices = devices
        self.space = space
        self._pruned: list[TrialResult] = []
        self._started = time.monotonic()
        self._profiled = False  # a profile launch has shown the script runs
        # Bytes per rank for any experiment: the analytic model plus per engine a line fitted to
        # every measured peak, refitted after each launch.
        zero = settings.base_config["zero_optimization"]
        self.memory = MemoryBook(config, self.space, settings.nproc_per_node, bool(zero.get("contiguous_gradients")),
                                 report, zero_settings=zero, engine=settings.engine,
                                 host_memory_bytes=devices.host_memory_bytes)
        self._profile_names: set[str] = set()
        self.predictions: PredictiveOutcome | None = None  # what tuner_type "predictive" predicted
        self.history = make_history(config.autotuning, results_dir, fingerprint, self.objective, report)
        stores = [JournalStore(exps_dir, fingerprint, report)] + ([HistoryStore(self.history)] if self.history else [])
        self.ledger = TrialLedger(stores)  # what has been tried: every phase reads and writes it
        self.ledger.on_record(self._recorded)
        self.launcher = RunnerLaunches(runner, self.ledger, self._trial, report)
        self.evaluator = Evaluator(self.ledger, self.launcher)
        self._similar_runs = SimilarRuns(self.history, tuner_spec(self.policy.tuner_type).uses_earlier_runs
                                         and bool(config.autotuning.transfer))
        self._prior = TransferPrior()  # earlier similar runs' steps, once the profile has checked them
        self.noise_scale: gradient_noise.NoiseScale | None = None  # metric goodput: what the profile measured

    # ----- set-up -----
    def _prepare_dirs(self) -> None:
        mark_work_started()  # a Ctrl-C from here on unwinds, so no write is cut in half
        if self.config.autotuning.overwrite:
            for directory in (self.exps_dir, self.results_dir):
                if directory.exists():
                    for child in directory.iterdir():
                        if child.name != ".lock" and not child.name.startswith(HISTORY_FILE):  # history stays
                            shutil.rmtree(child) if child.is_dir() else child.unlink()
        self.exps_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        for directory in (self.exps_dir, self.results_dir):  # ours alone: the tuner holds the lock
            sweep_partial_writes(directory)
        # Rescored: the objective and budget may have changed since (they are not fingerprinted).
        self.ledger.resume(lambda result: rescored(result, self.settings))

    def _profile_launch(self, stage: int, micro_batch_size: int) -> TrialResult:
        """A profile launch is the experiment at that stage and size (with its own gas), which also
        records the model; it counts as that experiment's measurement (under the stage's first
        variant, which the base config holds)."""
        experiment = self.space.experiment(stage, micro_batch_size).with_knobs(dict(self.space.variants_for(stage)[0]))
        self._profile_names.add(experiment.name)
        return self.evaluator.profile(experiment)

    def _profile_sizes(self) -> tuple[tuple[int, ...], Callable[[ModelProfile, int], int | None]]:
        """The first profile sizes to try, in order, and how the second size is chosen: about half
        the largest size the first launch predicts to fit, on the candidate ladder.

        The first is the smallest ladder size whose gas is at most PROFILE_MAX_GAS: with a global
        batch, the smallest valid size has the largest gas (micro-batch 1 x gas 64 runs 64
        forward/backward passes per step, several times a size-8 launch's time). Should it run
        out of memory at every stage, the smallest valid size is tried (if it does not fit,
        nothing does)."""
        space = self.space
        pool = self._size_pool()
        if not pool:
            return (space.min_micro_batch_size,), lambda profile, stage: None
        cheap = next((m for m in ladder_sizes(pool) if (space.gas(m) or 1) <= PROFILE_MAX_GAS), pool[0])
        first_sizes = (cheap, pool[0]) if cheap != pool[0] else (pool[0],)

        def second(profile: ModelProfile, stage: int) -> int | None:
            # This stage's first launch: the latest that ran (one at a lower stage may have run out of memory).
            first = next(r for r in reversed(self.ledger.results())
                         if r.model_info is not None and r.state is TrialState.OK)
            self.memory.settle_budget(first.model_info.device_memory_bytes)
            self.memory.use_profile(profile, first.model_info.precision)
            fitting = [m for m in pool if self.memory.fits(space.experiment(stage, m))]
            self.memory.profile = None
            if not fitting:
                return None
            # Cold or with similar earlier runs alike: a prior's choice here, checked against one
            # launch only, sent the profile to its own best size, and a model of another shape
            # (four times wider, say) was then picked 2%+ behind in a third of simulated tunes
            # (benchmarks/transfer_simulated.py, docs/benchmarks/transfer.md).
            target = max(fitting) / 2
            below = [m for m in ladder_sizes(fitting) if m <= target] or [min(fitting)]
            return max(below)

        return first_sizes, second

    def _size_pool(self) -> list[int]:
        space = self.space
        return space.valid_micro_batch_sizes(space.max_micro_batch_size)

    def _sharding_cannot_win(self, profile: ModelProfile, stage: int) -> str | None:
        """sharding_gain.py's verdict from the unsharded profile launches: does every size fit
        unsharded, and what do the probe's links cost FSDP2's collectives at."""
        infos = [r.model_info for r in self.ledger.results() if r.model_info is not None]
        steps = [r.measurement.latency for r in self.ledger.results()
                 if r.state is TrialState.OK and r.measurement is not None and r.measurement.latency > 0]
        if not steps:
            return None
        self.memory.use_profile(profile, infos[0].precision)
        unsharded = [s for s in self.space.stages if s < 2]
        fits_all = all(any(self.memory.fits(self.space.experiment(s, m)) for s in unsharded)
                       for m in self._size_pool())
        context = self._profiling_context(profile, infos[0].precision)
        return sharding_cannot_win(self.space.stages, fits_all, context, min(steps), NOISE_FLOOR)

    def _profiling_context(self, profile: ModelProfile, precision: str) -> CostContext:
        """The cost context while profiling, before the memory book holds the model (it reads the
        model's size and precision from there)."""
        self.memory.profile, self.memory.precision = profile, precision
        context = self.cost_context(quiet=True)
        self.memory.profile = None
        return context

    def _leave_out_sharding(self, reason: str) -> None:
        for stage in [s for s in self.space.stages if s >= 2]:
            self._prune(stage, reason)
        self.space = replace(self.space, stages=tuple(s for s in self.space.stages if s < 2))
        self.memory.space = self.space

    def _measure_model(self) -> None:
        tuning = self.config.autotuning
        if tuning.model_info is not None and tuning.model_info.num_params:
            self.memory.profile = replace(profile_from_config(tuning.model_info), engine=self.settings.engine)
            self.memory.precision = self.config.with_device_precision(self.devices.cuda_bf16).precision
            device_memory = self.devices.gpu_memory_bytes
            self.memory.device_type = "cuda" if device_memory else "cpu"
            self.report(f"model_info given: {self.memory.profile.num_params:,} parameters; no profile run")
        else:
            first_sizes, second_size = self._profile_sizes()
            outcome = profile_model(self.space.stages, self.settings, self._profile_launch, first_sizes, second_size,
                                    report=self.report, sharding_cannot_win=self._sharding_cannot_win)
            if outcome.profile is None:
                failure = outcome.failure
                where = self.exps_dir / failure.experiment.name
                raise TuningFailed(f"the model did not run in the profile launch ({failure.state.value}): "
                                   f"{failure.error}; see {where}/stderr.log")
            device_memory = outcome.device_memory_bytes
            self.memory.device_type = "cuda" if device_memory else "cpu"
            self.memory.use_profile(outcome.profile, outcome.runs[0].precision)
            if outcome.sharding_left_out:
                self._leave_out_sharding(outcome.sharding_left_out)
            if outcome.profile.engine == "deepspeed":
                self.report("engine: the script trains on DeepSpeed's own engine (DeepSpeedEngine); every experiment "
                            "runs there, costed by DeepSpeed's ZeRO memory model")
            self.memory.report_fits()
            self._profiled = True
            for line in profile_lines(self.memory.profile, self.memory.engine):
                self.report(line)
        by_policy = dict(self.memory.profile.activation_bytes_per_sample_by_policy)
        self.space, line = checkpointing_settled(self.space, by_policy, self._profiled)
        if line:
            self.report(line)
            self.memory.space = self.space
        self.memory.settle_budget(device_memory)
        self.memory.report_budget(dict(os.environ))

    def _settle_goodput(self) -> None:
        """metric "goodput": B_noise from the profile launches' gradient norms (or the user's
        critical_batch_size in its place), then every result so far judged again with it. Where
        neither is known, one line, and throughput decides."""
        if self.objective.metric != "goodput":
            return
        measured = [r.measurement for r in self.ledger.results() if r.measurement is not None]
        noise = gradient_noise.estimate(measured)
        given = self.config.autotuning.critical_batch_size
        if given is not None:
            objective = replace(self.objective, noise_scale=float(given))
            profiled = (f"the profile's B_noise {noise.b_noise:.1f} +/- {noise.spread:.1f}" if noise is not None
                        else "the profile did not measure B_noise")
            self.report(f"goodput: critical batch {given} (autotuning.critical_batch_size; {profiled}); each "
                        f"candidate scores its throughput x ({given} + {objective.reference_batch}) / ({given} + its "
                        f"global batch)")
        elif noise is None:
            why = ("too few steps, or noise that swamps the gradient: lengthen the profile window"
                   if any(m.gradient_norms for m in measured) else
                   "it is read on our engine at ZeRO 0 or 1, around the all-reduce with two ranks or more, or over "
                   "the micro-steps of one rank's gradient accumulation, and no profile launch ran so")
            self.report(f"goodput: the gradient noise scale was not measured ({why}); scoring by throughput")
            # The learning rate still follows the pick's global batch (lr_scaling), from the same reference.
            objective = Objective("throughput", reference_batch=self.objective.reference_batch)
        else:
            objective = replace(self.objective, noise_scale=noise.b_noise)
            self.report(f"goodput: gradient noise scale B_noise = {noise.b_noise:.1f} +/- {noise.spread:.1f} samples "
                        f"({noise.steps} steps of the profile); each candidate scores its throughput x "
                        f"(B_noise + {objective.reference_batch}) / (B_noise + its global batch). B_noise this early "
                        f"in training can be far below the critical batch at the loss you train to (15-65x on "
                        f"docs/benchmarks/goodput.md's tasks); where you know it, set autotuning.critical_batch_size")
        self.noise_scale = noise
        self.objective = objective
        self.settings = replace(self.settings, objective=objective)
        self.policy = replace(self.policy, objective=objective)
        self.ledger.rescore(lambda result: rescored(result, self.settings))

    def _follow_engine(self, built: str) -> None:
        """The profile launch's ranks say whose engine the script trains on. Where the settings had
        not settled it (a script that imports both engines) or expected the other (one that reaches
        deepspeed through a module not read), `settle_engine` refuses what is wrong for it, and the
        experiments' configs, the memory model and the searched dimensions follow it."""
        if self.settings.engine_settled and built == self.settings.engine:
            return
        self.report(self.settle_engine(built))
        if built != self.settings.engine:
            self.space = replace(self.space, **engine_dimensions(self.config, built, self.devices.on_gpu))
            self.memory.space = self.space
        self.settings = replace(self.settings, engine=built, engine_settled=True)

    def cost_context(self, quiet: bool = False) -> CostContext:
        """What the throughput model knows before timing a step: the model's size and the links the
        profile launches timed on the job's process group."""
        timings = [t for r in self.ledger.results() if r.model_info is not None
                   for t in r.model_info.collective_timings]
        links = tuple(fit_collectives(timings).values())
        if not links and self.settings.data_parallel_size > 1 and not quiet:
            self.report("predictive: no collective timings in the profile; communication is learned from "
                        "launches only")
        profile = self.memory.profile
        return CostContext(profile.num_params if profile else 0, self.settings.data_parallel_size,
                           COMPUTE_BYTES.get(self.memory.precision, 4), links, self._prior.observations,
                           self.memory.engine)

    # ----- the ledger's trials -----
    def _trial(self, experiment: Experiment, directory_name: str = "", profile: bool = False) -> Trial:
        """The launch of `experiment` in exps_dir/<directory_name, else its name>, with the settings
        as they stand (the profile may settle the engine); a profile launch carries no prediction."""
        predicted = None if profile else self.memory.predicted_memory(experiment)
        return Trial(experiment, self.exps_dir / (directory_name or experiment.name), self.settings,
                     profile=profile, predicted_memory_bytes=predicted)

    def _recorded(self, result: TrialResult, reused: bool) -> None:
        """Told of every result the ledger records: the progress line, the engine the first profile
        launch that ran built, and the memory model's refit."""
        self._progress(result, reused)
        if result.model_info is not None and result.name in self._profile_names:
            self._follow_engine(result.model_info.engine)  # settled at the first launch that ran, before any other
        self.memory.learn(result)

    def _prune(self, stage: int, reason: str, variant: tuple = ()) -> None:
        """A stage (or a variant of it: its reason starts with the variant) not searched further."""
        experiment = self.space.experiment(stage, self.space.min_micro_batch_size).with_knobs(dict(variant))
        self._pruned.append(TrialResult(experiment, TrialState.PRUNED, error=reason,
                                        predicted_memory_bytes=self.memory.predicted_memory(experiment)))
        own_reason = reason.split(": ", 1)[1] if variant else reason
        searched = "not launched" if own_reason.startswith(("memory model", REASON_PREFIX)) else "not searched further"
        self.report(f"ZeRO {stage}: pruned, {searched} ({reason})")

    def _progress(self, result: TrialResult, reused: bool) -> None:
        best = self.ledger.best(self.objective)
        value = f"{result.value:.4g} {self.objective.unit}" if result.value is not None else result.error
        best_text = f"{best.name} {best.value:.4g}" if best else "none yet"
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self._started))
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[{len(self.ledger)}] {result.name}: {result.state.value}{tag}: {value} | best {best_text} | "
                    f"elapsed {elapsed}")

    def tune(self) -> TuningOutcome:
        self._prepare_dirs()
        line = objective_line(self.settings.planned_steps, bool(self.config.autotuning.planned_steps),
                              bool(self.space.finishes))
        if line:
            self.report(line)
        self._measure_model()
        self._settle_goodput()
        # After the profile: the dimensions offered follow the engine its ranks built.
        for line in untuned_offload_lines(self.config, self.space, self.settings.engine, self.devices.on_gpu):
            self.report(line)
        self._prior = self._similar_runs.prior(  # the step-time model's prior, checked against the profile
            self.memory.profile, [r for r in self.ledger.results() if r.name in self._profile_names],
            lambda: self.cost_context(quiet=True), self.report)
        largest = self.memory.predicted_largest()
        self.report("memory model, largest micro-batch per stage: " + ", ".join(
            f"z{key}={m}" if isinstance(key, int) else f"z{key[0]} {variant_text(key[1])}={m}"
            for key, m in largest.items()))
        if tuner_spec(self.policy.tuner_type).search == "one_model":
            outcome = run_predictive_search(self.space, self.policy, largest, self.evaluator, self._prune,
                                            self.cost_context(), list(self.ledger.results()), self.memory.fits,
                                            self.memory.offload_fallback, self.report,
                                            on_ask=self.ledger.note_prediction, family=self.memory.family)
            self.predictions = outcome
        else:
            run_search(self.space, self.policy, largest, self.evaluator, self._prune, self.memory.fits,
                       self.memory.offload_fallback, self.report)
        best, remeasurements, pick_lines = self._final_pick(list(self.ledger.results()))
        record = SearchRecord(self.ledger.results(), tuple(self._pruned), frozenset(self._profile_names), best,
                              tuple(remeasurements), self._prior.lines + tuple(pick_lines), self.predictions,
                              time.monotonic() - self._started, self.noise_scale,
                              self.config.autotuning.critical_batch_size)  # the config allows it with goodput only
        outcome = write_outcome(record, self.settings, self.objective, self.results_dir, self.report,
                                self.devices.on_gpu)
        if self.history is not None and self.history.recorded:
            self.history.record_pick(best)
            self.report(f"history: {self.history.recorded} launches recorded in study {self.history.study_name}; "
                        f"list the runs with: launcher --history {self.history.url}")
        return outcome

    # ----- the final pick -----
    def _final_pick(self, results: list[TrialResult]) -> tuple[TrialResult | None, list, list[str]]:
        """Returns (the pick, with its median as value; the re-measurements; summary lines)."""
        tuning = self.config.autotuning
        # The predictive search's step-time model, on every launch, may rule a contender out.
        ruled_out = (pooled_rule(results, self.objective, self.cost_context(quiet=True))
                     if tuner_spec(self.policy.tuner_type).search == "one_model" else (lambda result, best: False))
        def reusable(experiment: Experiment, run: int) -> bool:
            return self.evaluator.earlier_remeasurement(experiment, run) is not None

        return final_pick_rounds(results, self.objective, tuning.remeasure_top, tuning.remeasure_rounds,
                                 self._remeasure, self.report, reusable, ruled_out)

    def _remeasure(self, experiment: Experiment, run: int, reuse: bool) -> TrialResult:
        result, reused = self.evaluator.remeasure(experiment, run, reuse)
        value = f"{result.value:.4g} {self.objective.unit}" if result.value is not None else result.error
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[re-measure {run}] {experiment.name}: {result.state.value}{tag}: {value}")
        return result
