"""Model-based search: a cost model fitted on finished experiments picks the most promising untried one.

The model is ridge regression on the experiments' numeric features, plus their squares
once there are enough results (a smooth response surface: throughput rises with
micro-batch and flattens). Failed
experiments are scored as the worst outcome so the model learns to avoid their region.
With probability `explore` an untried experiment is picked at random instead; the
random source is seeded by the seed and the trials held (`Tuner.draws`), so a run is reproducible.
"""

from __future__ import annotations

import numpy as np

from autotuner.tuning.space.records import TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.tuners.base import Tuner


class ModelBasedTuner(Tuner):
    def __init__(self, *args, initial_trials: int = 2, explore: float = 0.2, ridge: float = 1e-3, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial_trials = initial_trials
        self.explore = explore
        self.ridge = ridge
        self._feature_names = sorted({name for e in self.space for name in e.features()})

    def _vector(self, experiment: Experiment) -> np.ndarray:
        raw = experiment.features()
        base = np.array([raw.get(name, 0.0) for name in self._feature_names])
        # Squares (curvature) only once there are enough results to fit them; with few points
        # they would bend the extrapolation.
        if len(self.results) >= 2 * len(base) + 2:
            return np.concatenate([base, base**2])
        return base

    def _scores(self) -> tuple[np.ndarray, np.ndarray]:
        finished = list(self.results.values())
        values = [r.value for r in finished if r.state is TrialState.OK and r.value is not None]
        if self.objective.maximize:
            worst = 0.0
        else:
            worst = 2.0 * max(values) if values else 1.0
        x = np.array([self._vector(r.experiment) for r in finished])
        y = np.array([r.value if r.state is TrialState.OK and r.value is not None else worst for r in finished])
        return x, y

    def predict(self, candidates: list[Experiment]) -> np.ndarray:
        """Predicted objective value of each candidate from the results so far.

        Features are centred on the finished experiments and scaled by their spread over the
        space; the intercept is the mean score, so the ridge penalty shrinks slopes only."""
        x, y = self._scores()
        scale = np.array([self._vector(e) for e in self.space]).std(axis=0)
        scale[scale == 0] = 1.0
        centre = x.mean(axis=0)  # with the mean score as intercept
        xs = (x - centre) / scale
        mean = y.mean()
        weights = np.linalg.solve(xs.T @ xs + self.ridge * len(y) * np.eye(xs.shape[1]), xs.T @ (y - mean))
        return np.array([((self._vector(c) - centre) / scale) @ weights for c in candidates]) + mean

    def _choose(self, untried: list[Experiment]) -> Experiment:
        draws = self.draws()
        if not self.results or len(self.results) < self.initial_trials or draws.random() < self.explore:
            return draws.choice(untried)
        predicted = self.predict(untried)
        index = int(np.argmax(predicted) if self.objective.maximize else np.argmin(predicted))
        return untried[index]
