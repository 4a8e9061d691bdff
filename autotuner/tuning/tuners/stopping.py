"""When a drive stops: the stop-rule extension point (as optuna's callbacks may call `Study.stop()`).

A `StopRule` looks at a drive's `DriveProgress` and says whether to stop. The driver
(tuners/base.py `drive`, `drive_parallel`) asks every rule before each ask and after each result,
and stops once any says so: its own two (`MaxTrials`, `NoImprovement`, from the policy's
`tuner_num_trials` and `tuner_early_stopping`) and the tuner's own `Tuner.should_stop` (by
default never), so a tuner that stops itself (first_fit.py) needs no edit of the driver. A rule
reads only the progress it is given, so the same progress gets the same answer. Running out of
space, and the predictive search's `could_improve` (which judges the experiment just asked for),
stay the driver's.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Protocol, Sequence

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, TrialResult, TrialState


@dataclass(frozen=True)
class DriveProgress:
    """Where a drive stands when a rule is asked: `told`, everything the tuner holds a result of
    (told before this drive too: a confirmation run, say), a read-only copy; `results`, this
    drive's results in the order they arrived; `running`, how many this drive started and has not
    been told of (only a parallel drive has any)."""

    told: Mapping[Experiment, TrialResult]
    results: tuple[TrialResult, ...] = ()
    running: int = 0

    @classmethod
    def now(cls, told: Mapping[Experiment, TrialResult], results: Sequence[TrialResult],
            running: int = 0) -> DriveProgress:
        """A snapshot: later tells change neither mapping nor tuple."""
        return cls(MappingProxyType(dict(told)), tuple(results), running)

    @property
    def started(self) -> int:
        """How many experiments this drive has started: told or running."""
        return len(self.results) + self.running


class StopRule(Protocol):
    def should_stop(self, progress: DriveProgress) -> bool:
        """Whether the drive should start nothing more (what is running is still told)."""
        ...


@dataclass(frozen=True)
class MaxTrials:
    """Stop once this drive has started `count` experiments (`tuner_num_trials`, or what of it is left)."""

    count: int

    def should_stop(self, progress: DriveProgress) -> bool:
        return progress.started >= self.count


@dataclass(frozen=True)
class NoImprovement:
    """Stop once `patience` of this drive's results in a row (`tuner_early_stopping`) have not
    beaten the best so far, in the order they arrived; a failure never improves. `incumbent`: the
    best value before the drive (a confirmation run's counts as the best, not as a result)."""

    patience: int
    objective: Objective
    incumbent: float | None = None

    def should_stop(self, progress: DriveProgress) -> bool:
        if not progress.results:
            return False  # a patience of 0 still runs one: the streak is counted after a result
        best, streak = self.incumbent, 0
        for result in progress.results:
            if result.state is TrialState.OK and self.objective.better(result.value, best):
                best, streak = result.value, 0
            else:
                streak += 1
        return streak >= self.patience


def any_says_stop(rules: Sequence[StopRule], progress: DriveProgress) -> bool:
    return any(rule.should_stop(progress) for rule in rules)


__all__ = ["DriveProgress", "MaxTrials", "NoImprovement", "StopRule", "any_says_stop"]
