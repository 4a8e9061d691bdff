"""Grid search: the space in the order it was given."""

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.tuners.base import Tuner


class GridSearchTuner(Tuner):
    def _choose(self, untried: list[Experiment]) -> Experiment:
        return untried[0]
