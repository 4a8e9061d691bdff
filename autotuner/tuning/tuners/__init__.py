"""Search strategies behind one ask/tell interface."""

from autotuner.tuning.tuners.base import Tuner, drive
from autotuner.tuning.tuners.bayes import BayesTuner  # optuna is imported only when it asks
from autotuner.tuning.tuners.grid import GridSearchTuner
from autotuner.tuning.tuners.model_based import ModelBasedTuner
from autotuner.tuning.tuners.random_search import RandomTuner

TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
    "bayes": BayesTuner,
}


def make_tuner(tuner_type: str, space, objective, seed: int = 0) -> Tuner:
    return TUNERS[tuner_type](space, objective, seed=seed)


__all__ = ["TUNERS", "BayesTuner", "GridSearchTuner", "ModelBasedTuner", "RandomTuner", "Tuner", "drive", "make_tuner"]
