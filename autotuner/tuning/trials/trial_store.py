"""Where launches are kept beyond this process, behind one interface (as optuna's
storages/_base.py puts memory, RDB and journal storages behind one). A store's identity is the
run's fingerprint: the journal reuses only records made under it, the history keeps one study per it.

- `JournalStore`: exp.json in each experiment's directory (journal.py), what a resumed run reuses.
- `HistoryStore`: a trial of the run's optuna study (history.py), to compare runs; it resumes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from autotuner.core.atomic import sweep_partial_writes
from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.trials.history import History
from autotuner.tuning.trials.journal import Fingerprint, load_journal, write_entry
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.models.cost_model import Prediction

REMEASURE_TAG = "_remeasure"  # a re-measurement's directory: <experiment>_remeasure<round>


def remeasure_directory_name(name: str, run: int) -> str:
    return f"{name}{REMEASURE_TAG}{run}"


def phase_of(trial: Trial) -> str:
    """What the launch was for: "profile", "remeasure" (the final pick) or "search"."""
    return "profile" if trial.profile else "remeasure" if REMEASURE_TAG in trial.directory.name else "search"


class TrialStore(Protocol):
    fingerprint: Fingerprint

    def earlier(self) -> dict[str, TrialResult]:
        """Finished results an earlier run under this fingerprint kept, by directory name."""

    def keep(self, trial: Trial, result: TrialResult, prediction: Prediction | None) -> None:
        """One launch's result; `prediction`: what the predictive tuner expected of it when it asked."""


class JournalStore:
    """exp.json in each experiment's directory; records of another run are set aside when read."""

    def __init__(self, exps_dir: Path, fingerprint: Fingerprint, report: Callable[[str], None]):
        self.exps_dir = exps_dir
        self.fingerprint = fingerprint
        self._report = report

    def earlier(self) -> dict[str, TrialResult]:
        journal = load_journal(self.exps_dir, self.fingerprint)
        if journal.notice:
            self._report(journal.notice)
        return dict(journal.reusable)

    def keep(self, trial: Trial, result: TrialResult, prediction: Prediction | None = None) -> None:
        # Every process of the trial has ended: a write one was killed in the middle of is garbage.
        sweep_partial_writes(trial.directory)
        if result.state.finished:
            write_entry(trial.directory, result, self.fingerprint)


class HistoryStore:
    """The run's optuna study; a prediction is kept with search launches only."""

    def __init__(self, history: History):
        self.history = history
        self.fingerprint = history.fingerprint

    def earlier(self) -> dict[str, TrialResult]:
        return {}  # the journal is what a run resumes from

    def keep(self, trial: Trial, result: TrialResult, prediction: Prediction | None = None) -> None:
        phase = phase_of(trial)
        self.history.record(result, phase, prediction if phase == "search" else None)
