"""The trial ledger: what this run has tried, in one place (as an optuna study holds its frozen
trials, which samplers read and keep no copy of).

It holds this run's result per experiment with the kind of trial that first measured it (a
profile launch or a search's), what was pruned unlaunched and why, the final pick's
re-measurements, the records an earlier run under the same fingerprint
left (reused, not launched again), the launch count, the prediction each search launch was asked
on, every answer an evaluator gave (evaluator.py), so a search reads what it asked for from
here, and one `TunerTrials` per tuner: what that tuner was told and what it has running, which the
tuner reads and keeps no copy of (tuners/base.py). Launches reach the stores (trial_store.py: the
journal and the history) through `keep`. Nothing here launches.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.trials.trial_store import TrialStore
from autotuner.tuning.models.cost_model import Prediction

# Told of each result recorded: (the result, whether it is an earlier run's record).
RecordListener = Callable[[TrialResult, bool], None]


class TrialKind(str, enum.Enum):
    """Which phase measured an experiment first: its result counts as a candidate either way."""

    PROFILE = "profile"  # a profile launch: it also recorded the model
    SEARCH = "search"


class TunerTrials:
    """One tuner's trials (optuna's study, to its sampler): the results it was told, per experiment
    in the order told, those outside its space it was shown (`observed`), and the experiments it
    asked for that are still running. A tuner made without a ledger gets one of its own."""

    def __init__(self, label: str = ""):
        self.label = label  # which search's tuner, for a reader of the ledger
        self._told: dict[Experiment, TrialResult] = {}
        self._observed: dict[Experiment, TrialResult] = {}
        self._running: set[Experiment] = set()

    @property
    def told(self) -> Mapping[Experiment, TrialResult]:
        return MappingProxyType(self._told)

    @property
    def observed(self) -> Mapping[Experiment, TrialResult]:
        return MappingProxyType(self._observed)

    @property
    def running(self) -> frozenset[Experiment]:
        return frozenset(self._running)

    def __len__(self) -> int:
        """How many trials it holds, running ones included: a tuner's random draws are seeded by it."""
        return len(self._told) + len(self._running)

    def start(self, experiment: Experiment) -> None:
        self._running.add(experiment)

    def abandon(self, experiments: Sequence[Experiment]) -> None:
        """Asked for and then not started (a parallel search's stop rule held them back)."""
        self._running.difference_update(experiments)

    def tell(self, result: TrialResult) -> None:
        self._told[result.experiment] = result
        self._running.discard(result.experiment)

    def observe(self, result: TrialResult) -> None:
        self._observed[result.experiment] = result


class TrialLedger:
    def __init__(self, stores: Sequence[TrialStore] = ()):
        self._stores = tuple(stores)
        self._results: dict[Experiment, TrialResult] = {}
        self._kinds: dict[Experiment, TrialKind] = {}
        self._pruned: list[TrialResult] = []  # not launched, each with its reason as the error
        self._remeasured: list[tuple[int, TrialResult]] = []  # (round, result): the final pick's
        self._earlier: dict[str, TrialResult] = {}  # by directory name
        self._predictions: dict[Experiment, Prediction] = {}
        self._answers: list[TrialResult] = []
        self._listeners: list[RecordListener] = []
        self._tuner_trials: list[TunerTrials] = []
        self.launches = 0

    # ----- an earlier run's records -----
    def resume(self, rescore: Callable[[TrialResult], TrialResult] = lambda result: result) -> None:
        """Read what the stores kept of an earlier run under this fingerprint, each through `rescore`."""
        for store in self._stores:
            self._earlier.update({name: rescore(result) for name, result in store.earlier().items()})

    def earlier(self, experiment: Experiment, directory_name: str | None = None) -> TrialResult | None:
        """An earlier run's record of `experiment`'s launch in that directory (its own by default, a
        re-measurement's say); only when the record measured that experiment, not another that
        shares its name."""
        record = self._earlier.get(directory_name or experiment.name)
        return record if record is not None and record.experiment == experiment else None

    # ----- this run's results -----
    def known(self, experiment: Experiment) -> TrialResult | None:
        """This run's result for `experiment`, else an earlier run's record under its name (which
        is this run's once recorded), else None: it has to be launched. An earlier record is
        reused only for the experiment it measured, not for another that shares its name."""
        result = self._results.get(experiment)
        return result if result is not None else self.earlier(experiment)

    def __contains__(self, experiment: Experiment) -> bool:
        return experiment in self._results

    def __len__(self) -> int:
        return len(self._results)

    def record(self, result: TrialResult, reused: bool = False, kind: TrialKind = TrialKind.SEARCH) -> None:
        """The result of its experiment in this run (`reused`: an earlier run's record), measured
        by a trial of `kind`; the listeners are told after it is in."""
        self._results[result.experiment] = result
        self._kinds.setdefault(result.experiment, kind)
        for listener in self._listeners:
            listener(result, reused)

    def record_pruned(self, result: TrialResult) -> None:
        """An experiment standing for a stage or variant that is not searched (further), with why."""
        self._pruned.append(result)

    def record_remeasurement(self, round_: int, result: TrialResult) -> None:
        """The final pick's `round_`th re-measurement of an experiment; its first measurement stays
        the experiment's result (what the search compared)."""
        self._remeasured.append((round_, result))

    def rescore(self, rescore: Callable[[TrialResult], TrialResult]) -> None:
        """Every result judged again, in place (the objective changed: goodput's B_noise, once the
        profile measured it). The stores keep the measurements, which are unchanged; nobody is told."""
        self._results = {experiment: rescore(result) for experiment, result in self._results.items()}
        self._earlier = {name: rescore(result) for name, result in self._earlier.items()}  # reused later: alike

    def on_record(self, listener: RecordListener) -> None:
        self._listeners.append(listener)

    def results(self) -> tuple[TrialResult, ...]:
        """One result per experiment, in the order each experiment was first recorded."""
        return tuple(self._results.values())

    def of_kind(self, kind: TrialKind) -> tuple[TrialResult, ...]:
        """This run's results first measured by trials of `kind`, in order."""
        return tuple(r for experiment, r in self._results.items() if self._kinds[experiment] is kind)

    def pruned(self) -> tuple[TrialResult, ...]:
        return tuple(self._pruned)

    def remeasurements(self) -> tuple[tuple[int, TrialResult], ...]:
        return tuple(self._remeasured)

    # ----- the tuners' trials -----
    def open_tuner_trials(self, label: str) -> TunerTrials:
        """A new tuner's trials, kept here (each search makes its tuners afresh: one per stage, say)."""
        trials = TunerTrials(label)
        self._tuner_trials.append(trials)
        return trials

    def tuner_trials(self) -> tuple[TunerTrials, ...]:
        """Every tuner's trials, in the order the tuners were made."""
        return tuple(self._tuner_trials)

    # ----- launches -----
    def count_launch(self) -> None:
        self.launches += 1

    def note_prediction(self, experiment: Experiment, prediction: Prediction) -> None:
        """What the predictive tuner expected of `experiment` when it asked for it (kept with its launch)."""
        self._predictions[experiment] = prediction

    def keep(self, trial: Trial, result: TrialResult) -> None:
        """A launch's result into every store, with the prediction it was asked on."""
        for store in self._stores:
            store.keep(trial, result, self._predictions.get(trial.experiment))

    # ----- answers -----
    def answer(self, result: TrialResult) -> TrialResult:
        """An evaluator's answer (a result, or a refusal that is recorded nowhere else); returned."""
        self._answers.append(result)
        return result

    def mark(self) -> int:
        """Where the answers stand now: `answered(since=mark)` gives those after it."""
        return len(self._answers)

    def answered(self, since: int = 0) -> dict[Experiment, TrialResult]:
        """The answers given after `since`, the first per experiment, in the order given."""
        first: dict[Experiment, TrialResult] = {}
        for result in self._answers[since:]:
            first.setdefault(result.experiment, result)
        return first


class DegreeLedger:
    """The ledger as one tensor-parallel degree's search reads it: its own results, pruned and
    kinds (a degree's profile, memory model and search learn from its own launches only), while
    what it records goes into the one ledger, which keeps every degree's."""

    def __init__(self, ledger: TrialLedger, degree: int):
        self._ledger = ledger
        self.degree = degree

    def __getattr__(self, name: str):
        return getattr(self._ledger, name)  # recording, answers, earlier records: the ledger's own

    def __contains__(self, experiment: Experiment) -> bool:
        return experiment in self._ledger

    def __len__(self) -> int:
        return len(self._ledger)

    def _own(self, results: Sequence[TrialResult]) -> tuple[TrialResult, ...]:
        return tuple(r for r in results if r.experiment.tensor_parallel == self.degree)

    def results(self) -> tuple[TrialResult, ...]:
        return self._own(self._ledger.results())

    def of_kind(self, kind: TrialKind) -> tuple[TrialResult, ...]:
        return self._own(self._ledger.of_kind(kind))

    def pruned(self) -> tuple[TrialResult, ...]:
        return self._own(self._ledger.pruned())
