"""Search strategies behind one ask/tell interface, and the registry that names them.

A tuner is a `TunerSpec` in `TUNERS`: its name (the config's `autotuning.tuner_type`), its
factory, the search that drives it, and a check of what it needs installed. When a drive stops is
its own extension point (stopping.py): a tuner may stop itself with `should_stop`. The settle pass's
refusal of an unknown `tuner_type` reads the registry (the config's description lists the
built-in names by hand); a plugin adds one with `register_tuner` (core/plugins.py), with no edit
here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective
from autotuner.tuning.trials.ledger import TunerTrials
from autotuner.tuning.tuners.base import Tuner, drive
from autotuner.tuning.tuners.bayes import BayesTuner  # optuna is imported only when it asks
from autotuner.tuning.tuners.first_fit import FirstFitTuner
from autotuner.tuning.tuners.grid import GridSearchTuner
from autotuner.tuning.tuners.model_based import ModelBasedTuner
from autotuner.tuning.tuners.predictive import PredictiveTuner
from autotuner.tuning.tuners.random_search import RandomTuner
from autotuner.tuning.tuners.stopping import DriveProgress, StopRule


@dataclass(frozen=True)
class TunerArgs:
    """What a factory gets: the candidates, the objective, the seed, the step-time model's
    context (model size, timed links) for tuners that cost experiments, and the trials the tuner
    reads and writes (opened in the run's ledger; None: a set of its own)."""

    space: Sequence[Experiment]
    objective: Objective
    seed: int = 0
    cost_context: CostContext | None = None
    trials: TunerTrials | None = None


class SearchKind(str, enum.Enum):
    """How the orchestrator searches with a tuner."""

    PER_STAGE = "per_stage"  # the stage search asks it among each stage's micro-batch candidates (and,
    # in full mode, the knobs)
    ONE_MODEL = "one_model"  # the predictive search: one model over every stage


@dataclass(frozen=True)
class TunerSpec:
    name: str  # autotuning.tuner_type
    factory: Callable[[TunerArgs], Tuner]
    summary: str  # one line for the docs and the refusal of an unknown name
    search: SearchKind = SearchKind.PER_STAGE  # (a plugin may give the word: it is read as the kind)
    uses_earlier_runs: bool = False  # its model starts from similar earlier runs (autotuning.transfer)
    check: Callable[[str], None] | None = None  # refuses (exit 2) what it needs and lacks; gets the key's label

    def __post_init__(self) -> None:
        object.__setattr__(self, "search", SearchKind(self.search))  # an unknown word: ValueError, at registration


def _require_optuna(label: str) -> None:
    from autotuner.core.bayes import require_optuna

    require_optuna(label)


TUNERS: dict[str, TunerSpec] = {}


def register_tuner(spec: TunerSpec) -> TunerSpec:
    """Add a tuner; a name already taken is refused, so a plugin cannot replace a built-in unseen."""
    if spec.name in TUNERS and TUNERS[spec.name] is not spec:
        raise ValueError(f"tuner_type {spec.name!r} is registered already ({TUNERS[spec.name].factory!r})")
    TUNERS[spec.name] = spec
    return spec


for _spec in (
    TunerSpec("gridsearch", lambda a: GridSearchTuner(a.space, a.objective, seed=a.seed, trials=a.trials),
              "every candidate in order (DeepSpeed's default)"),
    TunerSpec("random", lambda a: RandomTuner(a.space, a.objective, seed=a.seed, trials=a.trials),
              "candidates in random order"),
    TunerSpec("model_based", lambda a: ModelBasedTuner(a.space, a.objective, seed=a.seed, trials=a.trials),
              "a cost model fitted on the results so far (DeepSpeed's XGBoost-style tuner)"),
    TunerSpec("bayes", lambda a: BayesTuner(a.space, a.objective, seed=a.seed, trials=a.trials),
              "optuna's GP or TPE sampler (pip install 'autotuner[bayes]')", check=_require_optuna),
    TunerSpec("predictive", lambda a: PredictiveTuner(a.space, a.objective, seed=a.seed, context=a.cost_context,
                                                  trials=a.trials),
              "one step-time model over every stage; launches only what could win (ours, the default)",
              search=SearchKind.ONE_MODEL, uses_earlier_runs=True),
    TunerSpec("first_fit", lambda a: FirstFitTuner(a.space, a.objective, seed=a.seed, trials=a.trials),
              "candidates in order, stopping at the first that runs"),
):
    register_tuner(_spec)

# The names this package registers (in that order), before any plugin's: what the golden record of
# launches covers (tests/unit/test_tuner_launches.py).
BUILT_IN_TUNERS: tuple[str, ...] = tuple(TUNERS)


def tuner_spec(name: str) -> TunerSpec:
    return TUNERS[name]


def make_tuner(tuner_type: str, space: Sequence[Experiment], objective: Objective, seed: int = 0,
               cost_context: Any = None, trials: TunerTrials | None = None) -> Tuner:
    """The tuner of that type over `space`, reading and writing `trials` (also where its factory
    made it with trials of its own: a new tuner holds none yet, so nothing is lost)."""
    tuner = TUNERS[tuner_type].factory(TunerArgs(space, objective, seed, cost_context, trials))
    if trials is not None and tuner.trials is not trials:
        if len(tuner.trials):
            raise ValueError(f"tuner_type {tuner_type!r}: its factory made a tuner that already holds trials")
        tuner.trials = trials
    return tuner


__all__ = ["BUILT_IN_TUNERS", "TUNERS", "BayesTuner", "DriveProgress", "FirstFitTuner", "GridSearchTuner",
           "ModelBasedTuner", "PredictiveTuner", "RandomTuner", "StopRule", "Tuner", "TunerArgs",
           "TunerSpec", "drive", "make_tuner", "register_tuner", "tuner_spec"]
