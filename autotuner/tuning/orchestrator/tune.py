"""The tune: each layout profiled, its memory model fitted and searched, then the final pick across
the layouts and the outcome."""

from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path
from typing import Callable

from autotuner.core.atomic import sweep_partial_writes
from autotuner.launch.stopping import mark_work_started
from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.models.memory_book import MemoryBook
from autotuner.tuning.profiling.job import ProfiledJob, TuningJob
from autotuner.tuning.profiling.phase import ProfilePhase, record_pruned
from autotuner.tuning.reports.outcome import SearchRecord, TuningOutcome, write_outcome
from autotuner.tuning.reports.layout_lines import kept_line
from autotuner.tuning.orchestrator.layout_outcome import LayoutOutcome, LayoutSearch, joined_predictions
from autotuner.tuning.orchestrator.plan import plan_layouts
from autotuner.tuning.reports.plan_table import PlanReport
from autotuner.tuning.searches.degree_bound import bound_verdict
from autotuner.tuning.searches.degree_memory import degree_memory_lines
from autotuner.tuning.searches.degree_time_check import degree_time_lines
from autotuner.tuning.searches.degree_rule import degree_cannot_help
from autotuner.tuning.searches.final_pick import final_pick_rounds
from autotuner.tuning.searches.predictive_search import run_predictive_search
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.searches.variant_rules import variant_text
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.planned_run import objective_line
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.trials.evaluator import Evaluator, RunnerLaunches, TrialFactory, TuningFailed
from autotuner.tuning.trials.history import HISTORY_FILE, make_history
from autotuner.tuning.trials.ledger import TrialKind, TrialLedger
from autotuner.tuning.trials.runner import Runner
from autotuner.tuning.trials.similar_runs import SimilarRuns
from autotuner.tuning.trials.trial import rescored
from autotuner.tuning.trials.trial_store import HistoryStore, JournalStore
from autotuner.tuning.tuners import SearchKind, tuner_spec
from autotuner.tuning.tuners.predictive import pooled_rule


def follow_the_launch(built: str) -> str:
    """The default for a script whose engine the command line did not settle: the launch's."""
    return f"engine: the profile launch's ranks built {built}'s engine; every experiment runs there"


class Autotuner:
    """Runs one tuning job: for each layout (tensor-parallel degree, pipeline stages), profile ->
    memory model -> search, each layout's outcome a frozen record the next reads (`LayoutOutcome`); then the final pick
    across them and the outcome. The profile phase (profiling/phase.py) turns the settled job into
    the profiled one, which nothing changes. `report` receives progress lines; `settle_engine`
    goes to the profile phase."""

    def __init__(self, job: TuningJob, results_dir: Path, exps_dir: Path, runner: Runner,
                 report: Callable[[str], None] = print, settle_engine: Callable[[str], str] = follow_the_launch):
        """`job`: the settle pass's (app/settle.py `tuning_job`), built once, with the runner's
        placement in it; the orchestrator reads it and builds no other."""
        self.job = job
        config = job.config
        self.settle_engine = settle_engine
        self.runner = runner
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.report = report
        self._started = time.monotonic()
        self.history = make_history(config.autotuning, results_dir, job.fingerprint, job.objective, report)
        stores = [JournalStore(exps_dir, job.fingerprint, report)] + ([HistoryStore(self.history)] if self.history else [])
        self.ledger = TrialLedger(stores)  # what has been tried: every phase reads and writes it
        self.ledger.on_record(self._progress)
        self.launcher = RunnerLaunches(runner, self.ledger, report)
        self.evaluator = Evaluator(self.ledger, self.launcher)
        self._similar_runs = SimilarRuns(self.history, tuner_spec(self.job.policy.tuner_type).uses_earlier_runs
                                         and bool(config.autotuning.transfer))
        self.outcomes: tuple[LayoutOutcome, ...] = ()  # each layout's, once the tune has run
        self._degree_lines: list[str] = []  # each degree's profile launches against degree 1's prediction

    @property
    def _searched(self) -> dict[Layout, LayoutSearch]:
        """The layouts searched (profiled), by Experiment.layout."""
        return {o.layout: o.searched for o in self.outcomes if o.searched is not None}

    @property
    def profiled(self) -> ProfiledJob | None:
        """The last layout profiled: its profile phase's record (a test's view after the tune)."""
        searched = list(self._searched.values())
        return searched[-1].profiled if searched else None

    @property
    def memory(self) -> MemoryBook | None:
        searched = list(self._searched.values())
        return searched[-1].memory if searched else None

    # ----- set-up -----
    def prepare_dirs(self) -> None:
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

    def cost_context(self, profiled: ProfiledJob, quiet: bool = False) -> CostContext:
        """The step-time model's context on a profiled job: the links its profile launches timed."""
        context = profiled.cost_context(self.ledger.view(profiled.job.space.layout).results())
        if not context.links and profiled.job.settings.data_parallel_size > 1 and not quiet:
            self.report("predictive: no collective timings in the profile; communication is learned from "
                        "launches only")
        return context

    # ----- the ledger's records, as they are appended -----
    def _progress(self, result: TrialResult, reused: bool) -> None:
        objective = self.job.objective
        if objective.metric == "goodput":  # scored with B_noise once a layout's profile measured it
            objective = next((s.profiled.job.objective for s in reversed(self._searched.values())), objective)
        best = objective.best(self.ledger.results())
        value = f"{result.value:.4g} {objective.unit}" if result.value is not None else result.error
        best_text = f"{best.name} {best.value:.4g}" if best else "none yet"
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self._started))
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[{len(self.ledger)}] {result.name}: {result.state.value}{tag}: {value} | best {best_text} | "
                    f"elapsed {elapsed}")

    def tune(self) -> TuningOutcome:
        self.prepare_dirs()
        job = self.job
        line = objective_line(job.settings.planned_steps, bool(job.config.autotuning.planned_steps),
                              bool(job.space.finishes))
        if line:
            self.report(line)
        for layout in job.layouts or (job.space.layout,):
            self.outcomes += (self._search_layout(layout, self.outcomes),)
        left_out = tuple(f"layout: {layout.text()}: left out ({why})" for layout, why in job.left_out)
        layout_lines = left_out + tuple(o.layout_line for o in self.outcomes if o.layout_line) + \
            tuple(self._degree_lines)
        if not self._searched:
            raise TuningFailed("no layout could be profiled: " + "; ".join(layout_lines))
        best, pick_lines = self._final_pick(list(self.ledger.results()))
        # The outcome is written with the pick's layout's job (its data-parallel size counts the batch).
        picked = self._searched.get(best.experiment.layout) if best else None
        profiled = (picked or next(iter(self._searched.values()))).profiled
        priors = tuple(line for s in self._searched.values() for line in s.profiled.prior.lines)
        record = SearchRecord(self.ledger.results(), self.ledger.pruned(),
                              frozenset(r.name for r in self.ledger.of_kind(TrialKind.PROFILE)), best,
                              self.ledger.remeasurements(), priors + tuple(pick_lines),
                              joined_predictions(self.outcomes),
                              time.monotonic() - self._started, profiled.noise_scale,
                              job.config.autotuning.critical_batch_size,  # the config allows it with goodput only
                              layout_lines + self._fixed_layout_lines(profiled.job),
                              job.config.autotuning.cost_per_gpu_hour,
                              (job.config.autotuning.adapt_interval, job.config.autotuning.max_train_batch_size)
                              if job.config.autotuning.adapt_batch else None, self.ledger.launches,
                              sum(1 for r in self.ledger.records if r.kind is TrialKind.REPEAT))
        outcome = write_outcome(record, profiled.job.settings, profiled.job.objective, self.results_dir,
                                job.devices.on_gpu, job.placement)
        if self.history is not None and self.history.recorded:
            self.history.record_pick(best)
            self.report(f"history: {self.history.recorded} launches recorded in study {self.history.study_name}; "
                        f"list the runs with: launcher --history {self.history.url}")
        return outcome

    def plan(self) -> PlanReport:
        """`--autotuning plan` (orchestrator/plan.py)."""
        return plan_layouts(self)

    def _hold_against_degree_one(self, layout: Layout, profiled: ProfiledJob, before: tuple[LayoutOutcome, ...],
                                 results) -> None:
        """Say how far degree 1's profile and launches predicted this degree's profile launches, their
        memory and step time (searches/degree_memory.py, degree_time_check.py); the lines join the
        summary's layout lines."""
        one = self._degree_one(layout, before)
        if one is None:
            return
        for line in degree_memory_lines(layout, one.searched.memory, one.layout, profiled.memory, results):
            self.report(f"memory model: {line}")
            self._degree_lines.append(f"layout: {line}")
        for line in degree_time_lines(layout, one.layout, list(self.ledger.view(one.layout).results()),
                                      profiled.memory.profile.params_per_rank, results, self.job.space.ranks):
            self.report(f"step-time model: {line}")
            self._degree_lines.append(f"layout: {line}")

    def _degree_one(self, layout: Layout, before: tuple[LayoutOutcome, ...]) -> LayoutOutcome | None:
        """The searched degree-1 layout `layout` is held against (the same pipeline), if any."""
        return next((o for o in before if o.searched is not None and o.layout.tensor_parallel <= 1
                     and o.layout.pipeline == layout.pipeline), None)

    def bound_line(self, layout: Layout, one: Layout | None) -> tuple[bool, str] | None:
        """Before a degree's profile: whether to skip it and the summary's line (searches/degree_bound.py)."""
        if one is None:
            return None
        return bound_verdict(layout, one, list(self.ledger.view(one).results()), self.job.at_layout(layout).space,
                             self.job.space.ranks, self.job.objective.metric, self.job.config.autotuning.bound_layouts)

    def profile_phase(self, layout: Layout) -> ProfilePhase:
        """The profile phase at one layout (the config's, where the layout is not searched): its
        job, launched through an evaluator reading that layout's records."""
        searching = bool(self.job.layouts)
        job = self.job.at_layout(layout) if searching else self.job
        evaluator = self.evaluator.for_job(TrialFactory(self.exps_dir, job.settings), layout if searching else None)
        return ProfilePhase(job, self.ledger, evaluator, self.report, self.settle_engine, self._similar_runs,
                            self.exps_dir)

    def _search_layout(self, layout: Layout, before: tuple[LayoutOutcome, ...]) -> LayoutOutcome:
        """The profile and the search at one layout (the config's, where the layout is not
        searched), after the layouts `before` it. A layout whose profile fails is left out when
        others remain."""
        searching = bool(self.job.layouts)
        one = self._degree_one(layout, before)
        bound = self.bound_line(layout, one.layout if one is not None else None) if searching else None
        if bound is not None:
            self.report(bound[1])
            if bound[0]:  # a degree that cannot beat degree 1's best: no profile, no search
                return LayoutOutcome(layout, None, layout_line=bound[1])
            self._degree_lines.append(bound[1])
        phase = self.profile_phase(layout)
        job = phase.job
        own = self.ledger.view(layout if searching else None)  # what this layout's phases read: its own records
        if searching:
            self.report(f"{layout.text()}: profiling and searching at data-parallel size "
                        f"{job.space.data_parallel_size}")
        try:
            profiled = phase.run()
        except TuningFailed as failure:
            if len(self.job.layouts) < 2:
                raise
            line = f"layout: {layout.text()}: left out ({failure})"
            self.report(line)
            return LayoutOutcome(layout, None, layout_line=line)
        if searching and layout.tensor_parallel > 1:
            self._hold_against_degree_one(layout, profiled, before, own.results())
        memory = MemoryBook(profiled.memory, own.results, self.report)
        # Refitted on each of this layout's results from here on (the profile's are fitted already).
        self.ledger.on_record(lambda result, reused: memory.learn(result)
                              if result.experiment.layout == layout else None)
        job = profiled.job
        evaluator = self.evaluator.for_job(TrialFactory(self.exps_dir, job.settings, memory.predicted_memory),
                                           layout if searching else None)
        searched = LayoutSearch(profiled, memory, evaluator)
        largest = memory.predicted_largest()
        self.report("memory model, largest micro-batch per stage: " + ", ".join(
            f"z{key}={m}" if isinstance(key, int) else f"z{key[0]} {variant_text(key[1])}={m}"
            for key, m in largest.items()))
        if searching:  # a layout that cannot beat one searched before is profiled only
            reached = {o.layout: (o.reach, self.ledger.view(o.layout).results()) for o in before
                       if o.reach is not None}
            why = degree_cannot_help(layout, (largest, own.results()), reached, job.objective.unit)
            if why is not None:
                line = (f"layout: {layout.text()} x data parallel {job.space.data_parallel_size}: "
                        f"profiled, not searched ({why})")
                self.report(line)
                return LayoutOutcome(layout, searched, largest, line)
        prune = partial(record_pruned, self.ledger, job.space, memory.predicted_memory, self.report)
        predicted = None
        if tuner_spec(job.policy.tuner_type).search is SearchKind.ONE_MODEL:
            predicted = run_predictive_search(
                job.space, job.policy, largest, evaluator, prune, self.cost_context(profiled), list(own.results()),
                memory.fits, memory.offload_fallback, self.report, on_ask=self.ledger.note_prediction,
                family=memory.family)
        else:
            run_search(job.space, job.policy, largest, evaluator, prune, memory.fits, memory.offload_fallback,
                       self.report)
        line = kept_line(layout, job.space, job.objective, job.config.zero_optimization.stages,
                         [r for r in own.results() if r.value is not None]) if searching else None
        return LayoutOutcome(layout, searched, largest, line, predicted)

    def _fixed_layout_lines(self, job: TuningJob) -> tuple[str, ...]:
        """The layout every experiment ran, where the config fixes a degree above 1 or the stages."""
        layout = job.space.layout
        if self.job.layouts or layout.model_ranks <= 1 and not layout.pipeline:
            return ()
        keys = " and ".join(key for key, _ in layout.tuned_values())
        return (f"layout: {layout.text()} x data parallel {job.settings.data_parallel_size} in every "
                f"experiment ({keys} as the config fixes it; \"auto\" or a list searches it)",)

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
        """A profiled layout's job: what every layout shares (the config, objective and policy)."""
        return next(iter(self._searched.values())).profiled.job

    def _final_pick(self, results: list[TrialResult]) -> tuple[TrialResult | None, list[str]]:
        """Returns (the pick, with its median as value; summary lines). The re-measurements are the ledger's."""
        job = self._any_job()
        tuning = job.config.autotuning
        # The predictive search's step-time model, on every launch, may rule a contender out: each
        # layout's model, on that layout's launches, a contender of the best's layout.
        rules = {layout: pooled_rule([r for r in results if r.experiment.layout == layout], job.objective,
                                     self.cost_context(searched.profiled, quiet=True))
                 for layout, searched in self._searched.items()
                 if tuner_spec(searched.profiled.job.policy.tuner_type).search is SearchKind.ONE_MODEL}

        def ruled_out(result: TrialResult, best: TrialResult) -> bool:
            layout = result.experiment.layout
            return layout == best.experiment.layout and layout in rules and rules[layout](result, best)

        def reusable(experiment: Experiment, run: int) -> bool:
            return self.evaluator.earlier_remeasurement(experiment, run) is not None  # (the ledger's)

        best, _, lines = final_pick_rounds(results, job.objective, tuning.remeasure_top, tuning.remeasure_rounds,
                                           self._remeasure, self.report, reusable, ruled_out)
        return best, lines

    def _remeasure(self, experiment: Experiment, run: int, reuse: bool) -> TrialResult:
        result, reused = self._searched[experiment.layout].evaluator.remeasure(experiment, run, reuse)
        objective = self._any_job().objective
        value = f"{result.value:.4g} {objective.unit}" if result.value is not None else result.error
        tag = " (from an earlier run)" if reused else ""
        self.report(f"[re-measure {run}] {experiment.name}: {result.state.value}{tag}: {value}")
        return result
