"""The evaluator: the one way an experiment is measured, over the trial ledger.

An answer is, in order: the one this search gave before (a search's evaluator, `for_search`),
a refusal (a variant that failed other than by memory: variant_rules.py `FailedVariants`), the
ledger's result (this run's, or an earlier run's record under its name), else a launch. One at a
time (`__call__`) or, with `capacity` above 1, in parallel (`submit`, then `next_result` as they
finish: tuners/base.py `drive_parallel`). Every answer is written to the ledger.

Only the launcher launches: the evaluator builds each trial from the job it was given
(`TrialFactory`: its settings and memory prediction), and `RunnerLaunches` hands it to the runner,
measures a disturbed window once more (interference.py) and keeps each launch's result in the
ledger's stores; `FunctionLaunches` stands a plain `evaluate` (a test's) in its place.
"""

from __future__ import annotations

import shutil
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

from autotuner.core.errors import AutotunerError
from autotuner.launch.stopping import raise_if_stopped
from autotuner.tuning.trials.trial import ExperimentSettings, Trial
from autotuner.tuning.trials.interference import interference_share
from autotuner.tuning.trials.ledger import LedgerView, TrialKind, TrialLedger, TunerTrials
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.runner import Runner
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.trials.trial_store import remeasure_directory_name
from autotuner.tuning.space.search_space import slots

DISTURBED_TAG = "_disturbed"  # a disturbed launch's directory, kept beside the one launched again


@dataclass(frozen=True)
class TrialFactory:
    """How the job an evaluator is given turns an experiment into a launch: in exps_dir/<name>,
    with the job's settings, carrying the memory model's prediction once there is one (a
    profile launch carries none)."""

    exps_dir: Path
    settings: ExperimentSettings
    predicted_memory: Callable[[Experiment], int] | None = None

    def trial(self, experiment: Experiment, directory_name: str = "", profile: bool = False) -> Trial:
        predicted = None if profile or self.predicted_memory is None else self.predicted_memory(experiment)
        return Trial(experiment, self.exps_dir / (directory_name or experiment.name), self.settings,
                     profile=profile, predicted_memory_bytes=predicted)


class TuningFailed(AutotunerError):
    """Nothing to choose from: the model did not run, or every experiment failed."""

    exit_code = 1


class ExperimentLauncher(Protocol):
    """What the evaluator launches through (not the `launcher` command): one experiment at a time,
    or `capacity` of them submitted at once."""

    capacity: int

    def launch(self, experiment: Experiment, trial: Trial | None) -> tuple[TrialResult, ...]:
        """Every launch's result in order (one, or more where a disturbed window was measured again)."""

    def submit(self, experiment: Experiment, trial: Trial | None) -> None: ...

    def next_result(self) -> TrialResult: ...


class RunnerLaunches:
    """Launches through a runner, each counted in the ledger and kept in its stores."""

    def __init__(self, runner: Runner, ledger: TrialLedger, report: Callable[[str], None]):
        self._runner = runner
        self._ledger = ledger
        self._report = report
        self.capacity = max(1, int(runner.capacity))
        self._always_busy = False  # two disturbed windows in a row: stop measuring windows again

    def run(self, trial: Trial) -> tuple[TrialResult, ...]:
        """Run one trial and keep each launch's result: a window another process disturbed is
        measured once more (interference.py), the disturbed launch's files moved aside to
        <directory>_disturbed first. Returns every launch's result in order; the last counts."""
        raise_if_stopped()
        result = self._runner.run(trial)
        results = [result]
        share = interference_share(result)
        if share is not None and not self._always_busy:
            self._report(f"{trial.experiment.name}: other processes took {share:.0%} of the CPUs during its profile "
                         "window; measuring it again")
            self._ledger.keep(self._set_aside(trial), result)
            result = self._runner.run(trial)
            results.append(result)
            again = interference_share(result)
            if again is not None:
                # The machine stays busy: a third window would be disturbed too. Every experiment is
                # then measured alike, and the interleaved final re-measurement compares them.
                self._always_busy = True
                self._report(f"other processes still took {again:.0%} of the CPUs; this machine stays busy, so "
                             "windows are no longer measured again (the final pick re-measures interleaved)")
        self._ledger.keep(trial, result)
        return tuple(results)

    @staticmethod
    def _set_aside(trial: Trial) -> Trial:
        """The trial as it stands in the directory its disturbed launch's files are moved to."""
        aside = trial.directory.with_name(trial.directory.name + DISTURBED_TAG)
        if trial.directory.exists():
            shutil.rmtree(aside, ignore_errors=True)
            trial.directory.rename(aside)
        return replace(trial, directory=aside)

    def launch(self, experiment: Experiment, trial: Trial | None) -> tuple[TrialResult, ...]:
        first = self._ledger.launches == 0
        results = self.run(trial)
        result = results[-1]
        if (first and result.state is TrialState.FAILED
                and not any(r.state is TrialState.OK for r in self._ledger.results())):
            # No result ran, so no profile launch did: a crash (not OOM) on the first launch is the
            # script or its arguments, not the configuration; every other experiment would fail alike.
            raise TuningFailed(f"the first experiment {result.name} failed: {result.error}; "
                               f"see {trial.directory}/stderr.log")
        return results

    def submit(self, experiment: Experiment, trial: Trial | None) -> None:
        raise_if_stopped()
        self._runner.submit(trial)

    def next_result(self) -> TrialResult:
        trial, result = self._runner.next_result()
        raise_if_stopped()  # a stop swallowed while it waited: this result may be one it cut short
        self._ledger.keep(trial, result)
        return result


class FunctionLaunches:
    """A plain `evaluate` as the launcher, with its parallel side when it has one."""

    def __init__(self, evaluate: Callable[[Experiment], TrialResult]):
        self._evaluate = evaluate
        self.capacity = slots(evaluate)

    def launch(self, experiment: Experiment, trial: Trial | None) -> tuple[TrialResult, ...]:
        return (self._evaluate(experiment),)

    def submit(self, experiment: Experiment, trial: Trial | None) -> None:
        self._evaluate.submit(experiment)  # type: ignore[attr-defined]

    def next_result(self) -> TrialResult:
        return self._evaluate.next_result()  # type: ignore[attr-defined]


class Refusals(Protocol):
    """What a search refuses to launch, read from the ledger's results (searches/variant_rules.py
    `FailedVariants`): given here so the ledger's side need not know the search's rules."""

    def refusal(self, experiment: Experiment) -> TrialResult | None: ...


class Evaluator:
    """`__call__` and `submit` launch only an experiment the ledger holds no result for, so one asked for again is not
    launched again (a parallel search submits only what its tuner asked, which it never asks twice:
    tuners/base.py `ask`). A search's evaluator (`for_search`) also refuses a failed variant, and
    gives an answer it gave before again as it was."""

    def __init__(self, ledger: TrialLedger, launcher: ExperimentLauncher, refusals: Refusals | None = None,
                 view: LedgerView | None = None, trials: TrialFactory | None = None):
        self.ledger = ledger
        self.view = view if view is not None else ledger.view()  # what its search reads: one layout's records, say
        self.trials = trials  # how its job's experiments are launched (a plain function's: none)
        self._launcher = launcher
        self._refusals = refusals
        self._since = ledger.mark()
        self.capacity = max(1, int(launcher.capacity))
        self._given: deque[TrialResult] = deque()  # submitted, answered by this search already or refused
        self._known: deque[TrialResult] = deque()  # submitted, answered by the ledger

    def for_search(self, refusals: Refusals) -> "Evaluator":
        """This evaluator for one search: its answers from here on, refusing what `refusals` refuses."""
        return Evaluator(self.ledger, self._launcher, refusals, self.view, self.trials)

    def for_job(self, trials: TrialFactory, layout: Layout | None = None) -> "Evaluator":
        """This evaluator for a job: launching its experiments through `trials`, reading one
        layout's records where `layout` is given (else the records it read)."""
        view = self.ledger.view(layout) if layout is not None else self.view
        return Evaluator(self.ledger, self._launcher, self._refusals, view, trials)

    def _trial(self, experiment: Experiment, directory_name: str = "", profile: bool = False) -> Trial | None:
        return self.trials.trial(experiment, directory_name, profile) if self.trials is not None else None

    def results(self) -> tuple[TrialResult, ...]:
        """The results its search reads (its view's)."""
        return self.view.results()

    def answered(self) -> list[TrialResult]:
        """The answers given since this evaluator was made, one per experiment, in the order given."""
        return list(self.ledger.answered(self._since).values())

    def _given_or_refused(self, experiment: Experiment) -> TrialResult | None:
        if self._refusals is None:
            return None
        given = self.ledger.answered(self._since).get(experiment)
        if given is not None:
            return given
        refused = self._refusals.refusal(experiment)
        return self.ledger.answer(refused, refused=True) if refused is not None else None

    def _answer(self, result: TrialResult) -> TrialResult:
        return self.ledger.answer(result)

    def _reuse(self, experiment: Experiment) -> TrialResult | None:
        known = self.ledger.known(experiment)
        if known is not None and experiment not in self.ledger:
            return self.ledger.record(known, reused=True)
        return known

    def __call__(self, experiment: Experiment) -> TrialResult:
        given = self._given_or_refused(experiment)
        if given is not None:
            return given
        result = self._reuse(experiment)
        if result is None:
            result = self.ledger.record_launches(self._launcher.launch(experiment, self._trial(experiment)))
        return self._answer(result)

    def submit(self, experiment: Experiment) -> None:
        given = self._given_or_refused(experiment)
        if given is not None:
            self._given.append(given)
            return
        known = self._reuse(experiment)
        if known is not None:
            self._known.append(known)
        else:
            self._launcher.submit(experiment, self._trial(experiment))

    def answer_ready(self) -> bool:
        """Whether `next_result` has an answer without waiting for a launch."""
        return bool(self._given or self._known)

    def next_result(self) -> TrialResult:
        """The next answer: those given at submit first, then the ledger's, then launches as they finish."""
        if self._given:
            return self._given.popleft()
        if self._known:
            return self._answer(self._known.popleft())
        return self._answer(self.ledger.record(self._launcher.next_result()))

    # ----- the orchestrator's launches outside the search (a runner's evaluator) -----
    def _runner_launches(self) -> RunnerLaunches:
        if not isinstance(self._launcher, RunnerLaunches) or self.trials is None:
            raise TypeError("profile and re-measurement launches need a runner (RunnerLaunches) and a job's trials")
        return self._launcher

    def profile(self, experiment: Experiment) -> TrialResult:
        """A profile launch (it also records the model): an earlier run's record of it when that
        holds the model, else launched; recorded either way, as its experiment's measurement."""
        launcher = self._runner_launches()
        earlier = self.ledger.earlier(experiment)
        # A failed record is launched again: what failed it (a metric it lacked, a window longer
        # than the script) may be what the user changed since.
        if earlier is not None and earlier.model_info is not None and earlier.state is not TrialState.FAILED:
            return self.ledger.record(earlier, True, TrialKind.PROFILE)
        return self.ledger.record_launches(launcher.run(self.trials.trial(experiment, "", True)), TrialKind.PROFILE)

    def earlier_remeasurement(self, experiment: Experiment, run: int) -> TrialResult | None:
        """An earlier run's record of the final pick's `run`th re-measurement of `experiment`."""
        return self.ledger.earlier(experiment, remeasure_directory_name(experiment.name, run))

    def remeasure(self, experiment: Experiment, run: int, reuse: bool) -> tuple[TrialResult, bool]:
        """The final pick's `run`th re-measurement of `experiment`, in its own directory: an earlier
        run's record of it where `reuse` and there is one, else launched. Returns (the result,
        whether it is an earlier run's); recorded in the ledger as a re-measurement, not as the
        experiment's result, which stays its first measurement."""
        launcher = self._runner_launches()
        earlier = self.earlier_remeasurement(experiment, run) if reuse else None
        name = remeasure_directory_name(experiment.name, run)
        if earlier is not None:
            return self.ledger.record_remeasurements(run, (earlier,), reused_from=name), True
        return self.ledger.record_remeasurements(run, launcher.run(self.trials.trial(experiment, name, False))), False


def open_tuner_trials(evaluate: Callable[[Experiment], TrialResult], label: str) -> TunerTrials | None:
    """A new tuner's trials in the ledger `evaluate` records into; None for a plain function (a
    test's), whose tuner then keeps a set of its own."""
    return evaluate.ledger.open_tuner_trials(label) if isinstance(evaluate, Evaluator) else None


def evaluator_of(evaluate: Callable[[Experiment], TrialResult]) -> Evaluator:
    """`evaluate` when it is an evaluator, else one over a ledger of its own that launches through
    it (a test's plain function, say)."""
    return evaluate if isinstance(evaluate, Evaluator) else Evaluator(TrialLedger(), FunctionLaunches(evaluate))
