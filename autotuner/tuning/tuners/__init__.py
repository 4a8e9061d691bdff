"""Search strategies behind one ask/tell interface."""

from autotuner.tuning.tuners.base import Tuner, drive
from autotuner.tuning.tuners.bayes import BayesTuner  # optuna is imported only when it asks
from autotuner.tuning.tuners.grid import GridSearchTuner
from autotuner.tuning.tuners.model_based import ModelBasedTuner
from autotuner.tuning.tuners.predictive import PredictiveTuner
from autotuner.tuning.tuners.random_search import RandomTuner

TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
    "bayes": BayesTuner,
    "predictive": PredictiveTuner,
}


def make_tuner(tuner_type: str, space, objective, seed: int = 0, cost_context=None) -> Tuner:
    """The tuner of that type over `space`; `cost_context` (model size, timed links) reaches the
    tuners that cost experiments (predictive)."""
    if tuner_type == "predictive":
        return PredictiveTuner(space, objective, seed=seed, context=cost_context)
    return TUNERS[tuner_type](space, objective, seed=seed)


__all__ = ["TUNERS", "BayesTuner", "GridSearchTuner", "ModelBasedTuner", "PredictiveTuner", "RandomTuner", "Tuner", "drive", "make_tuner"]
