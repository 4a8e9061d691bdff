"""The tuner interface: ask for the next experiment, tell the result. No I/O, no launching.

A tuner keeps no trials of its own (as an optuna sampler reads its study): what it was told and
what it has running live in its `TunerTrials`, which a search opens in the run's ledger
(trials/ledger.py). What a registered tuner asks next depends only on those trials and what it was
made with (space, objective, seed, cost context), so one made again over the same trials asks the
same (tests/unit/test_tuner_contract.py). The predictive search's subclass also keeps that
search's own decisions: which launch stands in for which, and why each was asked for."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Callable, Mapping, Sequence

from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.search_space import ParallelEvaluate, slots
from autotuner.tuning.trials.ledger import TunerTrials
from autotuner.tuning.tuners.stopping import DriveProgress, MaxTrials, NoImprovement, StopRule, any_says_stop


class Tuner(ABC):
    """Chooses the order in which a finite space is tried. Subclasses implement `_choose`."""

    def __init__(self, space: Sequence[Experiment], objective: Objective, seed: int = 0,
                 trials: TunerTrials | None = None):
        self.space: list[Experiment] = list(dict.fromkeys(space))
        self.objective = objective
        self.seed = seed
        self.trials = trials if trials is not None else TunerTrials(type(self).__name__)

    @property
    def results(self) -> Mapping[Experiment, TrialResult]:
        """What it was told, per experiment (read-only: `tell` writes)."""
        return self.trials.told

    @property
    def pending(self) -> frozenset[Experiment]:
        """Asked for and not told yet (running in parallel)."""
        return self.trials.running

    @abstractmethod
    def _choose(self, untried: list[Experiment]) -> Experiment:
        """Pick one of `untried` (never empty), using only `self.results` (and, for a random draw,
        `self.draws()`)."""

    def draws(self) -> random.Random:
        """A random source for one choice, seeded by the seed and how many trials are held: the
        same trials give the same draws, however the tuner came to hold them."""
        return random.Random(f"{self.seed}/{len(self.trials)}")

    def ask(self) -> Experiment | None:
        """The next experiment to run, or None when the space is exhausted. What was asked for
        and not told yet is never asked for again."""
        told, running = self.results, self.pending  # read once: `pending` is a copy
        untried = [e for e in self.space if e not in told and e not in running]
        if not untried:
            return None
        chosen = self._choose(untried)
        self.trials.start(chosen)
        return chosen

    def ask_batch(self, count: int) -> list[Experiment]:
        """Up to `count` distinct experiments to run at once (each chosen as if the ones before it
        were running); fewer when the space runs out."""
        batch = []
        while len(batch) < count:
            experiment = self.ask()
            if experiment is None:
                break
            batch.append(experiment)
        return batch

    def tell(self, result: TrialResult) -> None:
        """A result, in any order: results of a batch may arrive as their launches finish."""
        if result.experiment not in self.space:
            raise ValueError(f"{result.name} is not in this tuner's space")
        self.trials.tell(result)

    def should_stop(self, progress: DriveProgress) -> bool:
        """The tuner's own stop rule (stopping.py `StopRule`), asked by the driver with its own
        before each ask: whether to start nothing more. It reads only `progress`, so a tuner made
        again over the same trials says the same. By default a tuner never stops itself."""
        return False

    def could_improve(self, experiment: Experiment) -> bool:
        """Whether `experiment` could beat the best result so far. Tuners without a model of the
        objective cannot rule anything out."""
        return True

    def abandon(self, experiments: Sequence[Experiment]) -> None:
        """Asked for, then not started: they may be asked for again."""
        self.trials.abandon(experiments)

    def _measured(self) -> list[TrialResult]:
        """The results the tuner judges by: those it was told (a subclass may add what it observed)."""
        return list(self.results.values())

    @property
    def best(self) -> TrialResult | None:
        """The best of `_measured` by the objective (records.py `Objective.best`, the one rule)."""
        return self.objective.best(self._measured())


def drive(tuner: Tuner, evaluate: Callable[[Experiment], TrialResult], *, early_stopping: int,
          max_trials: int, trust_predictions: bool = False) -> list[TrialResult]:
    """Ask/evaluate/tell until the space is exhausted or a stop rule says stop (`stop_rules`:
    `max_trials` started, `early_stopping` results in a row without improvement, or the tuner's
    own `should_stop`); with `trust_predictions`, also when the tuner says the experiment it asks
    for could not beat the best so far. The rules are asked before each ask, so after each result
    too. An evaluate with a `capacity` above 1 gets an ask for every free slot (`drive_parallel`)."""
    if slots(evaluate) > 1:
        return drive_parallel(tuner, evaluate, early_stopping=early_stopping, max_trials=max_trials,  # type: ignore[arg-type]
                              trust_predictions=trust_predictions)
    results: list[TrialResult] = []
    rules = stop_rules(tuner, early_stopping=early_stopping, max_trials=max_trials)
    while not any_says_stop(rules, DriveProgress.now(tuner.results, results)):
        experiment = tuner.ask()
        if experiment is None:
            break
        if trust_predictions and not tuner.could_improve(experiment):
            tuner.abandon([experiment])  # asked, never started: the ledger must not hold it as running
            break
        result = evaluate(experiment)
        tuner.tell(result)
        results.append(result)
    return results


def stop_rules(tuner: Tuner, *, early_stopping: int, max_trials: int) -> tuple[StopRule, ...]:
    """The rules a drive of `tuner` asks: the driver's two, then the tuner's own. Made when the
    drive starts, so results told before it (a confirmation run's) set the best to beat."""
    incumbent = tuner.best
    return (MaxTrials(max_trials),
            NoImprovement(early_stopping, tuner.objective, incumbent.value if incumbent is not None else None),
            tuner)


def drive_parallel(tuner: Tuner, evaluate: ParallelEvaluate, *, early_stopping: int, max_trials: int,
                   trust_predictions: bool = False) -> list[TrialResult]:
    """`drive` with up to `evaluate.capacity` experiments running: each free slot is filled by an
    ask, results are told as they finish (in any order), and the stop rules read results in the
    order they arrive. An answer the evaluate already holds (a resumed run's record) is told
    before the next ask, as a launch's would have been: asked together, a resumed run's asks saw
    less than the first run's and could ask for what it never launched. Once a rule says stop,
    nothing new is started, whatever a rule says later, and the experiments still running are
    waited for (their results are kept and told)."""
    results: list[TrialResult] = []
    rules = stop_rules(tuner, early_stopping=early_stopping, max_trials=max_trials)
    running = 0
    stopping = False

    def check() -> bool:
        nonlocal stopping
        stopping = stopping or any_says_stop(rules, DriveProgress.now(tuner.results, results, running))
        return stopping

    def take() -> None:
        nonlocal running
        result = evaluate.next_result()
        running -= 1
        tuner.tell(result)
        results.append(result)
        check()  # a streak is judged at each result, as it arrives

    while True:
        while running < evaluate.capacity and not check():
            experiment = tuner.ask()
            if experiment is None:
                break
            if trust_predictions and not tuner.could_improve(experiment):
                tuner.abandon([experiment])
                stopping = True
                break
            evaluate.submit(experiment)
            running += 1
            if answer_ready(evaluate):
                take()
        if running == 0:
            break
        take()
    return results


def answer_ready(evaluate: ParallelEvaluate) -> bool:
    """Whether the evaluate's next result is already in hand (no launch to wait for)."""
    ready = getattr(evaluate, "answer_ready", None)
    return bool(ready()) if callable(ready) else False
