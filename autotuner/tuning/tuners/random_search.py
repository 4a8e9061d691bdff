"""Random search: a seeded, reproducible permutation of the space."""

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.tuners.base import Tuner


class RandomTuner(Tuner):
    def _choose(self, untried: list[Experiment]) -> Experiment:
        return self.draws().choice(untried)
