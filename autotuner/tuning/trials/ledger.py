"""The trial ledger: what this run has tried, as one append-only list of frozen records (as an
optuna study holds its frozen trials, which samplers read and keep no copy of).

Each `TrialRecord` is one thing that happened to one experiment: a profile, search or
re-measurement launch, the same trial launched again because another process disturbed its
window (`REPEAT`), a stage or variant pruned unlaunched, a search's refusal; an earlier run's
record reused is marked with where it came from. A record keeps what the launch measured; its
value is computed when read, under the scoring the ledger holds now (goodput's noise scale,
the budget), so a record never changes after it is appended. Everything else is a view:
`results()` (per experiment, its latest measurement), `of_kind`, `pruned`, `remeasurements`,
`view(layout)`. Appended launches reach the stores (trial_store.py: the journal and the
history) once each, through `keep`. One `TunerTrials` per tuner holds what that tuner was told
and has running, which the tuner reads and keeps no copy of (tuners/base.py). Nothing here launches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.trials.trial_store import TrialStore
from autotuner.tuning.models.cost_model import Prediction

# Told of each result recorded: (the result as scored now, whether it is an earlier run's record).
RecordListener = Callable[[TrialResult, bool], None]
# A launch's result judged under the run's scoring as it stands (trial.py `rescored`).
Scoring = Callable[[TrialResult], TrialResult]


class TrialKind(str, enum.Enum):
    """What a record is. The first three and `REPEAT` are launches (unless reused); a profile or
    search launch's result counts as a candidate either way."""

    PROFILE = "profile"  # a profile launch: it also recorded the model
    SEARCH = "search"
    REMEASURE = "remeasure"  # the final pick's: never the experiment's result
    REPEAT = "repeat"  # launched again after interference disturbed its window: the experiment's result now
    PRUNED = "pruned"  # a stage or variant not searched (further), with its reason
    REFUSED = "refused"  # a search's refusal (a failed variant's rules), not launched

    @property
    def measures(self) -> bool:
        """A kind whose record (or its latest repeat) is its experiment's measurement."""
        return self in (TrialKind.PROFILE, TrialKind.SEARCH)

    @property
    def launches(self) -> bool:
        return self in (TrialKind.PROFILE, TrialKind.SEARCH, TrialKind.REMEASURE, TrialKind.REPEAT)


@dataclass(frozen=True)
class TrialRecord:
    """One appended entry: `result` as the launch (or the rule) gave it, its `number` in the
    ledger, the re-measurement's `run`, the earlier run's directory it was `reused_from` ("" when
    this run made it), the prediction a search launch was asked on, and for a `REPEAT` the number
    of the record it launched again (which stays, disturbed, on record)."""

    number: int
    kind: TrialKind
    result: TrialResult
    run: int = 0
    reused_from: str = ""
    prediction: Prediction | None = None
    repeats: int | None = None

    @property
    def experiment(self) -> Experiment:
        return self.result.experiment

    @property
    def layout(self) -> Layout:
        return self.result.experiment.layout

    @property
    def launched(self) -> bool:
        """Whether this record is a launch of this run's (a reused record is not)."""
        return self.kind.launches and not self.reused_from


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
        self._records: list[TrialRecord] = []
        self._scoring: Scoring = lambda result: result  # a launch is scored as it ran until the objective changes
        self._earlier_scoring: Scoring = self._scoring  # an earlier run's records: under this run's objective
        self._scored: dict[int, TrialResult] = {}  # by record number, under the scoring now (a cache)
        self._earlier: Mapping[str, TrialResult] = MappingProxyType({})  # by directory name, as the stores kept them
        self._asked: dict[Experiment, Prediction] = {}  # the prediction of a launch asked for, until it is recorded
        self._answers: list[int] = []  # the record number of each answer an evaluator gave, in order
        self._listeners: list[RecordListener] = []
        self._tuner_trials: list[TunerTrials] = []

    # ----- scoring -----
    def score_with(self, scoring: Scoring) -> None:
        """Judge every record, this run's and an earlier run's, under `scoring` from now on (the
        objective changed: goodput's B_noise once the profile measured it). No record changes."""
        self._scoring = self._earlier_scoring = scoring
        self._scored = {}

    def scored(self, record: TrialRecord) -> TrialResult:
        """`record`'s result under the scoring now, computed from what it measured."""
        result = self._scored.get(record.number)
        if result is None:
            result = self._scored[record.number] = self._scoring(record.result)
        return result

    # ----- an earlier run's records -----
    def resume(self, scoring: Scoring = lambda result: result) -> None:
        """Read what the stores kept of an earlier run under this fingerprint, to be judged under
        `scoring` (this run's budget and objective, which the fingerprint leaves out)."""
        self._earlier_scoring = scoring
        earlier: dict[str, TrialResult] = {}
        for store in self._stores:
            earlier.update(store.earlier())
        self._earlier = MappingProxyType(earlier)

    def earlier(self, experiment: Experiment, directory_name: str | None = None) -> TrialResult | None:
        """An earlier run's record of `experiment`'s launch in that directory (its own by default, a
        re-measurement's say), under the scoring now; only when the record measured that
        experiment, not another that shares its name."""
        record = self._earlier.get(directory_name or experiment.name)
        return self._earlier_scoring(record) if record is not None and record.experiment == experiment else None

    # ----- appending -----
    @property
    def records(self) -> tuple[TrialRecord, ...]:
        return tuple(self._records)

    def _append(self, kind: TrialKind, result: TrialResult, *, run: int = 0, reused_from: str = "",
                repeats: int | None = None) -> TrialRecord:
        prediction = self._asked.pop(result.experiment, None) if kind is TrialKind.SEARCH else None
        record = TrialRecord(len(self._records), kind, result, run, reused_from, prediction, repeats)
        self._records.append(record)
        return record

    def _root(self, record: TrialRecord) -> TrialRecord:
        """The record a repeat launched again (itself for any other)."""
        return self._records[record.repeats] if record.repeats is not None else record

    def _launched_again(self, kind: TrialKind, results: Sequence[TrialResult], run: int = 0) -> TrialRecord:
        """One trial's launches in order: the first of `kind`, each launched again after it a
        `REPEAT` of that first one; returns the last record."""
        record = self._append(kind, results[0], run=run)
        for again in results[1:]:
            record = self._append(TrialKind.REPEAT, again, run=run, repeats=self._root(record).number)
        return record

    def record(self, result: TrialResult, reused: bool = False, kind: TrialKind = TrialKind.SEARCH) -> TrialResult:
        """A measurement of its experiment in this run (`reused`: an earlier run's record), by a
        trial of `kind`; the listeners are told after it is in. Returns it as scored now."""
        record = self._append(kind, result, reused_from=result.name if reused else "")
        scored = self.scored(record)
        for listener in self._listeners:
            listener(scored, reused)
        return scored

    def record_launches(self, results: Sequence[TrialResult], kind: TrialKind = TrialKind.SEARCH) -> TrialResult:
        """One trial's launches (more than one where interference disturbed a window): the last
        is the experiment's measurement; the listeners are told of it. Returns it as scored now."""
        scored = self.scored(self._launched_again(kind, results))
        for listener in self._listeners:
            listener(scored, False)
        return scored

    def record_pruned(self, result: TrialResult) -> None:
        """An experiment standing for a stage or variant that is not searched (further), with why."""
        self._append(TrialKind.PRUNED, result)

    def record_remeasurements(self, round_: int, results: Sequence[TrialResult], reused_from: str = "") -> TrialResult:
        """The final pick's `round_`th re-measurement of an experiment (its launches, or the
        earlier run's record in the directory `reused_from`); the experiment's result stays its
        first measurement (what the search compared). Returns the last as scored now."""
        if reused_from:
            return self.scored(self._append(TrialKind.REMEASURE, results[-1], run=round_, reused_from=reused_from))
        return self.scored(self._launched_again(TrialKind.REMEASURE, results, round_))

    def on_record(self, listener: RecordListener) -> None:
        self._listeners.append(listener)

    # ----- views -----
    def view(self, layout: Layout | None = None) -> "LedgerView":
        return LedgerView(self, layout)

    def _measurements(self, layout: Layout | None = None) -> dict[Experiment, tuple[TrialRecord, TrialRecord]]:
        """Per experiment, in the order first measured: (its first measuring record, its latest)."""
        found: dict[Experiment, tuple[TrialRecord, TrialRecord]] = {}
        for record in self._records:
            if self._root(record).kind.measures and (layout is None or record.layout == layout):
                first = found.get(record.experiment, (record, record))[0]
                found[record.experiment] = (first, record)
        return found

    def known(self, experiment: Experiment) -> TrialResult | None:
        """This run's result for `experiment`, else an earlier run's record under its name (which
        is this run's once recorded), else None: it has to be launched. An earlier record is
        reused only for the experiment it measured, not for another that shares its name."""
        measured = self._measurements().get(experiment)
        return self.scored(measured[1]) if measured is not None else self.earlier(experiment)

    def __contains__(self, experiment: Experiment) -> bool:
        return any(r.kind.measures and r.experiment == experiment for r in self._records)  # (a repeat's root is one)

    def __len__(self) -> int:
        return len(self._measurements())

    @property
    def launches(self) -> int:
        """This run's launches so far: every launched record (repeats and re-measurements included)."""
        return sum(1 for record in self._records if record.launched)

    def results(self) -> tuple[TrialResult, ...]:
        return self.view().results()

    def of_kind(self, kind: TrialKind) -> tuple[TrialResult, ...]:
        return self.view().of_kind(kind)

    def pruned(self) -> tuple[TrialResult, ...]:
        return self.view().pruned()

    def remeasurements(self) -> tuple[tuple[int, TrialResult], ...]:
        latest: dict[int, TrialRecord] = {}  # by the re-measurement's first record: its last launch
        for record in self._records:
            if self._root(record).kind is TrialKind.REMEASURE:
                latest[self._root(record).number] = record
        return tuple((r.run, self.scored(r)) for r in latest.values())

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
    def note_prediction(self, experiment: Experiment, prediction: Prediction) -> None:
        """What the predictive tuner expected of `experiment` when it asked for it (kept with its record)."""
        self._asked[experiment] = prediction

    def keep(self, trial: Trial, result: TrialResult) -> None:
        """A launch's result into every store, with the prediction it was asked on."""
        for store in self._stores:
            store.keep(trial, result, self._asked.get(trial.experiment))

    # ----- answers -----
    def answer(self, result: TrialResult, refused: bool = False) -> TrialResult:
        """An evaluator's answer: a measurement this ledger holds (by its experiment's latest
        record), or a refusal, appended as a record of its own. Returned as scored now."""
        if refused:
            record = self._append(TrialKind.REFUSED, result)
        else:
            record = self._measurements()[result.experiment][1]
        self._answers.append(record.number)
        return self.scored(record)

    def mark(self) -> int:
        """Where the answers stand now: `answered(since=mark)` gives those after it."""
        return len(self._answers)

    def answered(self, since: int = 0) -> dict[Experiment, TrialResult]:
        """The answers given after `since`, the first per experiment, in the order given."""
        first: dict[Experiment, TrialResult] = {}
        for number in self._answers[since:]:
            record = self._records[number]
            if record.experiment not in first:
                first[record.experiment] = self.scored(record)
        return first


@dataclass(frozen=True)
class LedgerView:
    """The ledger filtered: one layout's records (a layout's profile, memory model and search learn
    from its own launches only), or all of them (`layout` None)."""

    ledger: TrialLedger
    layout: Layout | None = None

    def _own(self, records: Iterable[TrialRecord]) -> tuple[TrialResult, ...]:
        return tuple(self.ledger.scored(r) for r in records if self.layout is None or r.layout == self.layout)

    def results(self) -> tuple[TrialResult, ...]:
        """One result per experiment (its latest measurement), in the order each was first measured."""
        return self._own(latest for _, latest in self.ledger._measurements(self.layout).values())

    def of_kind(self, kind: TrialKind) -> tuple[TrialResult, ...]:
        """The results of the experiments first measured by trials of `kind`, in order."""
        return self._own(latest for first, latest in self.ledger._measurements(self.layout).values()
                         if first.kind is kind)

    def pruned(self) -> tuple[TrialResult, ...]:
        return self._own(r for r in self.ledger.records if r.kind is TrialKind.PRUNED)

    def __len__(self) -> int:
        return len(self.results())
