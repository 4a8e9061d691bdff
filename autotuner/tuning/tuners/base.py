"""The tuner interface: ask for the next experiment, tell the result. No I/O, no launching."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from autotuner.tuning.records import Objective, TrialResult, TrialState
from autotuner.tuning.space import Experiment


class Tuner(ABC):
    """Chooses the order in which a finite space is tried. Subclasses implement `_choose`."""

    def __init__(self, space: Sequence[Experiment], objective: Objective, seed: int = 0):
        self.space: list[Experiment] = list(dict.fromkeys(space))
        self.objective = objective
        self.seed = seed
        self.results: dict[Experiment, TrialResult] = {}

    @abstractmethod
    def _choose(self, untried: list[Experiment]) -> Experiment:
        """Pick one of `untried` (never empty), using only `self.results`."""

    def ask(self) -> Experiment | None:
        """The next experiment to run, or None when the space is exhausted."""
        untried = [e for e in self.space if e not in self.results]
        return self._choose(untried) if untried else None

    def tell(self, result: TrialResult) -> None:
        if result.experiment not in self.space:
            raise ValueError(f"{result.name} is not in this tuner's space")
        self.results[result.experiment] = result

    def could_improve(self, experiment: Experiment) -> bool:
        """Whether `experiment` could beat the best result so far. Tuners without a model of the
        objective cannot rule anything out."""
        return True

    @property
    def best(self) -> TrialResult | None:
        return self.objective.best(list(self.results.values()))


def drive(tuner: Tuner, evaluate: Callable[[Experiment], TrialResult], *, early_stopping: int,
          max_trials: int, trust_predictions: bool = False) -> list[TrialResult]:
    """Ask/evaluate/tell until the space is exhausted, `max_trials` ran, or `early_stopping`
    experiments in a row brought no improvement; with `trust_predictions`, also when the tuner
    says the experiment it asks for could not beat the best so far."""
    results: list[TrialResult] = []
    incumbent = tuner.best  # results told before driving (e.g. a confirmation run) count
    best: float | None = incumbent.value if incumbent is not None else None
    without_improvement = 0
    while len(results) < max_trials:
        experiment = tuner.ask()
        if experiment is None or (trust_predictions and not tuner.could_improve(experiment)):
            break
        result = evaluate(experiment)
        tuner.tell(result)
        results.append(result)
        if result.state is TrialState.OK and tuner.objective.better(result.value, best):
            best, without_improvement = result.value, 0
        else:
            without_improvement += 1
            if without_improvement >= early_stopping:
                break
    return results
