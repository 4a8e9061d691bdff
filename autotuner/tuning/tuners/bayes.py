"""Bayesian optimisation (optuna's GP sampler, seeded) over a finite space of experiments.

Each feature of the experiments (stage, log2 micro-batch, log2 gas, knobs) is an ordinal axis of
its distinct values. optuna proposes a point from the results so far; the untried experiment
nearest to it (in each axis's index, scaled to [0, 1]) is the one asked. A failed experiment is
scored as the worst outcome, so the sampler learns to avoid its region. Same optimiser as the
online tuner (`autotuner.core.bayes`); optuna is an extra: pip install 'autotuner[bayes]'.
"""

from __future__ import annotations

from autotuner.core.bayes import BayesianOptimizer
from autotuner.tuning.space.records import TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.tuners.base import Tuner


class BayesTuner(Tuner):
    def __init__(self, *args, sampler: str = "gp", **kwargs):
        super().__init__(*args, **kwargs)
        self.sampler = sampler
        names = sorted({name for e in self.space for name in e.features()})
        self._axes = {name: tuple(sorted({e.features().get(name, 0.0) for e in self.space})) for name in names}

    def _point(self, experiment: Experiment) -> dict[str, float]:
        features = experiment.features()
        return {name: features.get(name, 0.0) for name in self._axes}

    def _scores(self) -> list[tuple[Experiment, float]]:
        """Results as higher-is-better scores; failures at the worst end."""
        sign = 1.0 if self.objective.maximize else -1.0
        values = [r.value for r in self.results.values() if r.state is TrialState.OK and r.value is not None]
        worst = 0.0 if self.objective.maximize else -2.0 * max(values, default=0.5)
        return [(r.experiment, sign * r.value if r.state is TrialState.OK and r.value is not None else worst)
                for r in self.results.values()]

    def _position(self, point: dict[str, float]) -> tuple[float, ...]:
        return tuple(axis.index(point[name]) / max(1, len(axis) - 1) for name, axis in self._axes.items())

    def _choose(self, untried: list[Experiment]) -> Experiment:
        # A fresh study each time, seeded by how many results it holds: the same results give
        # the same proposal, so a run (and a resumed run) is reproducible.
        optimizer = BayesianOptimizer(self._axes, seed=self.seed + len(self.results), sampler=self.sampler,
                                      startup_trials=max(2, min(5, len(self.space) // 4)))
        for experiment, score in self._scores():
            optimizer.observe(self._point(experiment), score)
        target = self._position(optimizer.ask())

        def distance(experiment: Experiment) -> float:
            here = self._position(self._point(experiment))
            return sum((a - b) ** 2 for a, b in zip(here, target))

        return min(untried, key=distance)  # min keeps the first of equals: space order breaks ties
