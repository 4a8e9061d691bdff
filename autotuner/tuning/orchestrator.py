"""The one orchestrator: profile -> memory model -> search (ask/run/tell) -> results."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autotuner.core.atomic import sweep_partial_writes
from autotuner.config.models import DeepSpeedConfig
from autotuner.launch.stopping import mark_work_started
from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.models.memory_book import MemoryBook
from autotuner.tuning.profiling.job import ProfiledJob, TuningJob
from autotuner.tuning.profiling.phase import ProfilePhase, record_pruned
from autotuner.tuning.reports.outcome import SearchRecord, TuningOutcome, write_outcome
from autotuner.tuning.searches.degree_rule import degree_cannot_help
from autotuner.tuning.searches.final_pick import final_pick_rounds
from autotuner.tuning.searches.predictive_search import PredictiveOutcome, run_predictive_search
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.searches.variant_rules import variant_text
from autotuner.tuning.space.devices import DeviceFacts
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.planned_run import objective_line
from autotuner.tuning.space.records import Reason, TrialResult
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.trials.evaluator import Evaluator, RunnerLaunches, TuningFailed
from autotuner.tuning.trials.history import HISTORY_FILE, make_history
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.trials.ledger import TrialKind, TrialLedger
from autotuner.tuning.trials.runner import Runner
from autotuner.tuning.trials.similar_runs import SimilarRuns
from autotuner.tuning.trials.trial import ExperimentSettings, Trial, rescored
from autotuner.tuning.trials.trial_store import HistoryStore, JournalStore
from autotuner.tuning.tuners import tuner_spec
from autotuner.tuning.tuners.predictive import pooled_rule


@dataclass(frozen=True)
class DegreeSearch:
    """One tensor-parallel degree's profiled job and memory model (a tune that does not search the
    degree has one, at the config's layout)."""

    profiled: ProfiledJob
    memory: MemoryBook


def kept_line(degree: int, job: TuningJob, measured: list[TrialResult]) -> str:
    """The summary's line for a degree searched: its best, and how its global batch was kept."""
    dp, space = job.space.data_parallel_size, job.space
    top = job.objective.best(measured)
    line = f"layout: tensor parallel {degree} x data parallel {dp}: kept, {len(measured)} measured"
    if top is not None:
        e = top.experiment
        line += (f", best {top.name} {top.value:.4g} {job.objective.unit} (global batch {e.train_batch_size(dp)} = "
                 f"micro-batch {e.micro_batch_size} x gas {e.gradient_accumulation_steps} x {dp})")
    if space.global_batch_size is not None:
        kind = "train_batch_size" if space.global_batch_exact else "max_train_batch_size"
        line += (f"; {kind} {space.global_batch_size} holds at this degree: micro-batch x gas make up for the "
                 f"data-parallel size, and sizes that cannot are not candidates")
    return line


def follow_the_launch(built: str) -> str:
    """The default for a script whose engine the command line did not settle: the launch's."""
    return f"engine: the profile launch's ranks built {built}'s engine; every experiment runs there"


class Autotuner:
    """Runs one tuning job: the profile phase (profiling/phase.py) turns the settled job into the
    profiled one; the search, the final pick and the outcome read that record, which nothing
    changes. `report` receives progress lines; `settle_engine` goes to the profile phase."""

    def __init__(self, config: DeepSpeedConfig, settings: ExperimentSettings, results_dir: Path, exps_dir: Path,
                 runner: Runner, fingerprint: Fingerprint, report: Callable[[str], None] = print,
                 settle_engine: Callable[[str], str] = follow_the_launch, *, devices: DeviceFacts,
                 space: SearchSpace, degrees: tuple[int, ...] = (), left_out: tuple[tuple[int, str], ...] = ()):
        """`devices` and `space`: the settle pass's (app/settle.py), read and built once there;
        `degrees`: the tensor-parallel degrees it settled to search, each in turn (none: the
        config's layout), and those it `left_out` with why."""
        self.job = TuningJob.settled(config, settings, space, devices, degrees, left_out)
        self.settle_engine = settle_engine
        self.runner = runner
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.report = report
        self._started = time.monotonic()
        self.history = make_history(config.autotuning, results_dir, fingerprint, settings.objective, report)
        stores = [JournalStore(exps_dir, fingerprint, report)] + ([HistoryStore(self.history)] if self.history else [])
        self.ledger = TrialLedger(stores)  # what has been tried: every phase reads and writes it
        self.ledger.on_record(self._recorded)
        self.launcher = RunnerLaunches(runner, self.ledger, self._trial, report)
        self.evaluator = Evaluator(self.ledger, self.launcher)
        self._similar_runs = SimilarRuns(self.history, tuner_spec(self.job.policy.tuner_type).uses_earlier_runs
                                         and bool(config.autotuning.transfer))
        self._phase = ProfilePhase(self.job, self.ledger, self.evaluator, report, settle_engine, self._similar_runs,
                                   exps_dir)
        self.profiled: ProfiledJob | None = None  # the degree searched now: its profile phase's record
        self.memory: MemoryBook | None = None  # on its profiled job's facts, over its ledger's peaks
        self._searched: dict[int, DegreeSearch] = {}  # by Experiment.tensor_parallel, as each is profiled
        self._layout_lines: list[str] = []  # the summary's: each degree kept or left out, and why
        self._reach: dict[int, tuple] = {}  # each degree profiled: (its memory reach, its ledger)
        self._predictions: PredictiveOutcome | None = None  # what tuner_type "predictive" predicted

    # ----- set-up -----
    def _prepare_dirs(self) -> None:
        mark_work_started()  # a Ctrl-C from here on unwinds, so no write is cut in half
        if self.job.config.autotuning.overwrite:
            for directory in (self.exps_dir, self.results_dir):
                if directory.exists():
                    for child in directory.iterdir():
                        if child.name != ".lock" and not child.name.startswith(HISTORY_FILE):  # history stays
                            shutil.rmtree(child) if child.is_dir() else child.unlink()
        self.exps_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        for directory in (self.exps_dir, self.results_dir):  # ours alone: the tuner holds the lock
            sweep_partial_writes(directory)
        # Scored under this run's objective and budget: they may have changed since (they are not fingerprinted).
        settings = self.job.settings
        self.ledger.resume(lambda result: rescored(result, settings))

    def _current_job(self) -> TuningJob:
        """The job as it stands: the profile phase's until it returns the profiled one."""
        return self.profiled.job if self.profiled is not None else self._phase.job

    def cost_context(self, profiled: ProfiledJob | None = None, quiet: bool = False) -> CostContext:
        """The step-time model's context on a profiled job (the degree searched now by default): the
        links its profile launches timed."""
        profiled = profiled or self.profiled
        degree = profiled.job.space.tensor_parallel
        context = profiled.cost_context(self.ledger.view(degree).results())
        if not context.links and profiled.job.settings.data_parallel_size > 1 and not quiet:
            self.report("predictive: no collective timings in the profile; communication is learned from "
                        "launches only")
        return context

    # ----- the ledger's trials -----
    def _trial(self, experiment: Experiment, directory_name: str = "", profile: bool = False) -> Trial:
        """The launch of `experiment` in exps_dir/<directory_name, else its name>, with the job's
        settings as they stand (the profile may settle the engine); a profile launch carries no prediction."""
        searched = self._searched.get(experiment.tensor_parallel)  # (each degree counts its own dp)
        job = searched.profiled.job if searched is not None else self._current_job()
        predicted = None if profile or searched is None else searched.memory.predicted_memory(experiment)
        return Trial(experiment, self.exps_dir / (directory_name or experiment.name), job.settings,
                     profile=profile, predicted_memory_bytes=predicted)

    def _recorded(self, result: TrialResult, reused: bool) -> None:
        """Told of every result the ledger records: the progress line and the memory model's refit
        (once the profile made it: the profile launches are fitted when it is)."""
        self._progress(result, reused)
        searched = self._searched.get(result.experiment.tensor_parallel)
        if searched is not None:
            searched.memory.learn(result)

    def _prune(self, stage: int, reason: Reason, text: str, variant: tuple = ()) -> None:
        record_pruned(self.ledger, self.profiled.job.space, self.memory.predicted_memory, self.report, stage, reason,
                      text, variant)

    def _progress(self, result: TrialResult, reused: bool) -> None:
        objective = self._current_job().objective
        best = objective.best(list(self.ledger.results()))
        value = f"{result.value:.4g} {objective.unit}" if result.value is not None else result.error
        best_text = f"{best.name} {best.value:.4g}" if best else "none yet"
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self._started))
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[{len(self.ledger)}] {result.name}: {result.state.value}{tag}: {value} | best {best_text} | "
                    f"elapsed {elapsed}")

    def tune(self) -> TuningOutcome:
        self._prepare_dirs()
        job = self.job
        line = objective_line(job.settings.planned_steps, bool(job.config.autotuning.planned_steps),
                              bool(job.space.finishes))
        if line:
            self.report(line)
        self._layout_lines = [f"layout: tensor parallel {degree}: left out ({why})" for degree, why in job.left_out]
        for degree in job.degrees or (job.space.tensor_parallel,):
            self._search_degree(degree)
        if not self._searched:
            raise TuningFailed("no tensor-parallel degree could be profiled: " + "; ".join(self._layout_lines))
        best, pick_lines = self._final_pick(list(self.ledger.results()))
        # The outcome is written with the pick's degree's job (its data-parallel size counts the batch).
        picked = self._searched.get(best.experiment.tensor_parallel) if best else None
        profiled = (picked or next(iter(self._searched.values()))).profiled
        priors = tuple(line for s in self._searched.values() for line in s.profiled.prior.lines)
        record = SearchRecord(self.ledger.results(), self.ledger.pruned(),
                              frozenset(r.name for r in self.ledger.of_kind(TrialKind.PROFILE)), best,
                              self.ledger.remeasurements(), priors + tuple(pick_lines), self._predictions,
                              time.monotonic() - self._started, profiled.noise_scale,
                              job.config.autotuning.critical_batch_size,  # the config allows it with goodput only
                              tuple(self._layout_lines) + self._fixed_layout_lines(profiled.job),
                              job.config.autotuning.cost_per_gpu_hour,
                              (job.config.autotuning.adapt_interval, job.config.autotuning.max_train_batch_size)
                              if job.config.autotuning.adapt_batch else None, self.ledger.launches,
                              sum(1 for r in self.ledger.records if r.kind is TrialKind.REPEAT))
        outcome = write_outcome(record, profiled.job.settings, profiled.job.objective, self.results_dir,
                                job.devices.on_gpu)
        if self.history is not None and self.history.recorded:
            self.history.record_pick(best)
            self.report(f"history: {self.history.recorded} launches recorded in study {self.history.study_name}; "
                        f"list the runs with: launcher --history {self.history.url}")
        return outcome

    def _search_degree(self, degree: int) -> None:
        """The profile and the search at one tensor-parallel degree (the config's layout, where the
        degree is not searched). A degree whose profile fails is left out when others remain."""
        searching = bool(self.job.degrees)
        self.profiled = self.memory = None  # until this degree's profile: its phase's job is the current one
        job = self.job.at_degree(degree) if searching else self.job
        evaluator = self.evaluator.at_degree(degree) if searching else self.evaluator
        ledger = evaluator.view  # what this degree's phases read: its own records
        if searching:
            self._phase = ProfilePhase(job, self.ledger, evaluator, self.report, self.settle_engine, self._similar_runs,
                                       self.exps_dir)
            self.report(f"tensor parallel {degree}: profiling and searching at data-parallel size "
                        f"{job.space.data_parallel_size}")
        try:
            self.profiled = profiled = self._phase.run()
        except TuningFailed as failure:
            if len(self.job.degrees) < 2:
                raise
            self._layout_lines.append(f"layout: tensor parallel {degree}: left out ({failure})")
            self.report(self._layout_lines[-1])
            return
        self.memory = memory = MemoryBook(profiled.memory, ledger.results, self.report)
        self._searched[degree] = DegreeSearch(profiled, memory)
        job = profiled.job
        largest = memory.predicted_largest()
        self.report("memory model, largest micro-batch per stage: " + ", ".join(
            f"z{key}={m}" if isinstance(key, int) else f"z{key[0]} {variant_text(key[1])}={m}"
            for key, m in largest.items()))
        if searching:  # a degree that cannot beat one searched before is profiled only
            before = {d: (reached, own.results()) for d, (reached, own) in self._reach.items()}  # searched since
            why = degree_cannot_help(degree, (largest, ledger.results()), before, job.objective.unit)
            self._reach[degree] = (largest, ledger)
            if why is not None:
                self._layout_lines.append(f"layout: tensor parallel {degree} x data parallel "
                                          f"{job.space.data_parallel_size}: profiled, not searched ({why})")
                self.report(self._layout_lines[-1])
                return
        if tuner_spec(job.policy.tuner_type).search == "one_model":
            predicted = run_predictive_search(
                job.space, job.policy, largest, evaluator, self._prune, self.cost_context(), list(ledger.results()),
                memory.fits, memory.offload_fallback, self.report, on_ask=self.ledger.note_prediction,
                family=memory.family)
            earlier = self._predictions  # a degree search: every degree's, in turn
            self._predictions = predicted if earlier is None else PredictiveOutcome(
                earlier.results + predicted.results, earlier.at_launch + predicted.at_launch,
                earlier.final + predicted.final)
        else:
            run_search(job.space, job.policy, largest, evaluator, self._prune, memory.fits, memory.offload_fallback,
                       self.report)
        if searching:
            self._layout_lines.append(kept_line(degree, job, [r for r in ledger.results() if r.value is not None]))

    def _fixed_layout_lines(self, job: TuningJob) -> tuple[str, ...]:
        """The layout every experiment ran, where the config fixes a degree above 1."""
        degree = job.space.tensor_parallel
        if self.job.degrees or degree <= 1:
            return ()
        return (f"layout: tensor parallel {degree} x data parallel {job.settings.data_parallel_size} in every "
                "experiment (tensor_parallel.autotp_size as the config fixes it; \"auto\" or a list searches it)",)

    def keep_late_noise(self) -> None:
        """After the pick's training: the B_noise its batch ramp read last goes to the history, for
        the next tune of the same model family (said in one line)."""
        from autotuner.tuning.reports.batch_ramp_plan import late_noise

        late = late_noise(self.results_dir)
        if late is None or self.history is None:
            return
        self.history.record_late_noise(late)
        self.report(f"history: the training run's late B_noise {late['b_noise']:.1f} (step {late['step']}) kept in "
                    f"study {self.history.study_name}; the next goodput tune of this model family scores with it")

    # ----- the final pick -----
    def _any_job(self) -> TuningJob:
        """A profiled degree's job: what every degree shares (the config, objective and policy)."""
        return next(iter(self._searched.values())).profiled.job

    def _final_pick(self, results: list[TrialResult]) -> tuple[TrialResult | None, list[str]]:
        """Returns (the pick, with its median as value; summary lines). The re-measurements are the ledger's."""
        job = self._any_job()
        tuning = job.config.autotuning
        # The predictive search's step-time model, on every launch, may rule a contender out: each
        # degree's model, on that degree's launches, a contender of the best's degree.
        rules = {degree: pooled_rule([r for r in results if r.experiment.tensor_parallel == degree], job.objective,
                                     self.cost_context(searched.profiled, quiet=True))
                 for degree, searched in self._searched.items()
                 if tuner_spec(searched.profiled.job.policy.tuner_type).search == "one_model"}

        def ruled_out(result: TrialResult, best: TrialResult) -> bool:
            degree = result.experiment.tensor_parallel
            return degree == best.experiment.tensor_parallel and degree in rules and rules[degree](result, best)

        def reusable(experiment: Experiment, run: int) -> bool:
            return self.evaluator.earlier_remeasurement(experiment, run) is not None

        best, _, lines = final_pick_rounds(results, job.objective, tuning.remeasure_top, tuning.remeasure_rounds,
                                           self._remeasure, self.report, reusable, ruled_out)
        return best, lines

    def _remeasure(self, experiment: Experiment, run: int, reuse: bool) -> TrialResult:
        result, reused = self.evaluator.remeasure(experiment, run, reuse)
        objective = self._any_job().objective
        value = f"{result.value:.4g} {objective.unit}" if result.value is not None else result.error
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[re-measure {run}] {experiment.name}: {result.state.value}{tag}: {value}")
        return result
