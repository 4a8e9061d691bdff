"""The one orchestrator: profile -> memory model -> search (ask/run/tell) -> results."""

from __future__ import annotations

import shutil
import time
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
from autotuner.tuning.searches.final_pick import final_pick_rounds
from autotuner.tuning.searches.predictive_search import run_predictive_search
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.searches.variant_rules import variant_text
from autotuner.tuning.space.devices import DeviceFacts
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.planned_run import objective_line
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.trials.evaluator import Evaluator, RunnerLaunches
from autotuner.tuning.trials.history import HISTORY_FILE, make_history
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.trials.ledger import TrialKind, TrialLedger
from autotuner.tuning.trials.runner import Runner
from autotuner.tuning.trials.similar_runs import SimilarRuns
from autotuner.tuning.trials.trial import ExperimentSettings, Trial, rescored
from autotuner.tuning.trials.trial_store import HistoryStore, JournalStore
from autotuner.tuning.tuners import tuner_spec
from autotuner.tuning.tuners.predictive import pooled_rule


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
                 space: SearchSpace):
        """`devices` and `space`: the settle pass's (app/settle.py), read and built once there."""
        self.job = TuningJob.settled(config, settings, space, devices)
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
        self.profiled: ProfiledJob | None = None  # set once, when the profile phase returns it
        self.memory: MemoryBook | None = None  # on the profiled job's facts, over the ledger's peaks

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
        # Rescored: the objective and budget may have changed since (they are not fingerprinted).
        settings = self.job.settings
        self.ledger.resume(lambda result: rescored(result, settings))

    def _current_job(self) -> TuningJob:
        """The job as it stands: the profile phase's until it returns the profiled one."""
        return self.profiled.job if self.profiled is not None else self._phase.job

    def cost_context(self, quiet: bool = False) -> CostContext:
        """The step-time model's context on the profiled job: the links the profile launches timed."""
        context = self.profiled.cost_context(self.ledger.results())
        if not context.links and self.profiled.job.settings.data_parallel_size > 1 and not quiet:
            self.report("predictive: no collective timings in the profile; communication is learned from "
                        "launches only")
        return context

    # ----- the ledger's trials -----
    def _trial(self, experiment: Experiment, directory_name: str = "", profile: bool = False) -> Trial:
        """The launch of `experiment` in exps_dir/<directory_name, else its name>, with the job's
        settings as they stand (the profile may settle the engine); a profile launch carries no prediction."""
        predicted = None if profile or self.memory is None else self.memory.predicted_memory(experiment)
        return Trial(experiment, self.exps_dir / (directory_name or experiment.name), self._current_job().settings,
                     profile=profile, predicted_memory_bytes=predicted)

    def _recorded(self, result: TrialResult, reused: bool) -> None:
        """Told of every result the ledger records: the progress line and the memory model's refit
        (once the profile made it: the profile launches are fitted when it is)."""
        self._progress(result, reused)
        if self.memory is not None:
            self.memory.learn(result)

    def _prune(self, stage: int, reason: str, variant: tuple = ()) -> None:
        record_pruned(self.ledger, self.profiled.job.space, self.memory.predicted_memory, self.report, stage, reason,
                      variant)

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
        self.profiled = profiled = self._phase.run()
        self.memory = memory = MemoryBook(profiled.memory, self.ledger.results, self.report)
        job = profiled.job
        largest = memory.predicted_largest()
        self.report("memory model, largest micro-batch per stage: " + ", ".join(
            f"z{key}={m}" if isinstance(key, int) else f"z{key[0]} {variant_text(key[1])}={m}"
            for key, m in largest.items()))
        predictions = None  # what tuner_type "predictive" predicted
        if tuner_spec(job.policy.tuner_type).search == "one_model":
            predictions = run_predictive_search(job.space, job.policy, largest, self.evaluator, self._prune,
                                                self.cost_context(), list(self.ledger.results()), memory.fits,
                                                memory.offload_fallback, self.report,
                                                on_ask=self.ledger.note_prediction, family=memory.family)
        else:
            run_search(job.space, job.policy, largest, self.evaluator, self._prune, memory.fits,
                       memory.offload_fallback, self.report)
        best, pick_lines = self._final_pick(list(self.ledger.results()))
        record = SearchRecord(self.ledger.results(), self.ledger.pruned(),
                              frozenset(r.name for r in self.ledger.of_kind(TrialKind.PROFILE)), best,
                              self.ledger.remeasurements(),
                              profiled.prior.lines + tuple(pick_lines), predictions,
                              time.monotonic() - self._started, profiled.noise_scale,
                              job.config.autotuning.critical_batch_size)  # the config allows it with goodput only
        outcome = write_outcome(record, job.settings, job.objective, self.results_dir, self.report,
                                job.devices.on_gpu)
        if self.history is not None and self.history.recorded:
            self.history.record_pick(best)
            self.report(f"history: {self.history.recorded} launches recorded in study {self.history.study_name}; "
                        f"list the runs with: launcher --history {self.history.url}")
        return outcome

    # ----- the final pick -----
    def _final_pick(self, results: list[TrialResult]) -> tuple[TrialResult | None, list[str]]:
        """Returns (the pick, with its median as value; summary lines). The re-measurements are the ledger's."""
        job = self.profiled.job
        tuning = job.config.autotuning
        # The predictive search's step-time model, on every launch, may rule a contender out.
        ruled_out = (pooled_rule(results, job.objective, self.cost_context(quiet=True))
                     if tuner_spec(job.policy.tuner_type).search == "one_model" else (lambda result, best: False))

        def reusable(experiment: Experiment, run: int) -> bool:
            return self.evaluator.earlier_remeasurement(experiment, run) is not None

        best, _, lines = final_pick_rounds(results, job.objective, tuning.remeasure_top, tuning.remeasure_rounds,
                                           self._remeasure, self.report, reusable, ruled_out)
        return best, lines

    def _remeasure(self, experiment: Experiment, run: int, reuse: bool) -> TrialResult:
        result, reused = self.evaluator.remeasure(experiment, run, reuse)
        objective = self.profiled.job.objective
        value = f"{result.value:.4g} {objective.unit}" if result.value is not None else result.error
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[re-measure {run}] {experiment.name}: {result.state.value}{tag}: {value}")
        return result
