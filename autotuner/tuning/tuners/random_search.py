"""Random search: a seeded, reproducible permutation of the space."""

import random

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.tuners.base import Tuner


class RandomTuner(Tuner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rng = random.Random(self.seed)

    def _choose(self, untried: list[Experiment]) -> Experiment:
        return self._rng.choice(untried)
