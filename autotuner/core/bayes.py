"""Bayesian optimisation over a small discrete space, by optuna (GP or TPE sampler), seeded.

Shared by the online tuner (inside rank 0 of a training job) and the full-mode `bayes` tuner.
Every dimension is an ordered tuple of choices: booleans become optuna categoricals, anything
else the integer index of its choice (so 2^p bucket sizes are an ordinal axis, as Bagua's
`bucket_size_2p` is). optuna is an optional extra: `pip install 'autotuner[bayes]'`.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Mapping

from autotuner.core.errors import UnsupportedError

SamplerName = Literal["gp", "tpe"]
INSTALL_HINT = "pip install 'autotuner[bayes]' (optuna and scipy)"


def require_optuna(what: str) -> None:
    """Raise one clear line when optuna (or scipy, which its GP sampler needs) is missing."""
    try:
        import optuna  # noqa: F401
        import scipy  # noqa: F401
    except ImportError as err:
        raise UnsupportedError(f"{what} needs optuna and scipy ({err.name} is not installed); {INSTALL_HINT}") from None


def _is_bool(choices: tuple[Any, ...]) -> bool:
    return all(isinstance(c, bool) for c in choices)


def _sampler(name: SamplerName, seed: int, startup_trials: int):
    import optuna

    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup_trials)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)
    raise ValueError(f"sampler {name!r}: expected 'gp' or 'tpe'")


class BayesianOptimizer:
    """ask() -> a point (name -> choice); tell(point, score). Higher scores are better.

    A point may be asked again: in a noisy space a repeat is a useful measurement."""

    def __init__(self, dimensions: Mapping[str, tuple[Any, ...]], *, seed: int = 0, sampler: SamplerName = "gp",
                 startup_trials: int = 4):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.dimensions = {name: tuple(choices) for name, choices in dimensions.items()}
        for name, choices in self.dimensions.items():
            if not choices:
                raise ValueError(f"dimension {name!r} has no choices")
        self._distributions = {name: self._distribution(choices) for name, choices in self.dimensions.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna's ExperimentalWarning for the GP sampler
            self._study = optuna.create_study(direction="maximize", sampler=_sampler(sampler, seed, startup_trials))
        self._pending: dict[tuple, list[Any]] = {}

    @staticmethod
    def _distribution(choices: tuple[Any, ...]):
        from optuna.distributions import CategoricalDistribution, IntDistribution

        if _is_bool(choices):
            return CategoricalDistribution(list(choices))
        return IntDistribution(0, len(choices) - 1)

    def _encode(self, point: Mapping[str, Any]) -> dict[str, Any]:
        encoded = {}
        for name, choices in self.dimensions.items():
            value = point[name]
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {choices}")
            encoded[name] = value if _is_bool(choices) else choices.index(value)
        return encoded

    def _decode(self, params: Mapping[str, Any]) -> dict[str, Any]:
        point = {}
        for name, choices in self.dimensions.items():
            value = params[name]
            point[name] = value if _is_bool(choices) else choices[int(value)]
        return point

    @staticmethod
    def _key(point: Mapping[str, Any]) -> tuple:
        return tuple(sorted(point.items()))

    def enqueue(self, point: Mapping[str, Any]) -> None:
        """Ask this point next (e.g. the starting knobs, so they get a real score)."""
        self._study.enqueue_trial(self._encode(point))

    def ask(self) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = self._study.ask(self._distributions)
        point = self._decode(trial.params)
        self._pending.setdefault(self._key(point), []).append(trial)
        return point

    def tell(self, point: Mapping[str, Any], score: float) -> None:
        """The score of a point: of the oldest pending ask of it, or a new observation."""
        pending = self._pending.get(self._key(point))
        if pending:
            self._study.tell(pending.pop(0), float(score))
            return
        self.observe(point, score)

    def observe(self, point: Mapping[str, Any], score: float) -> None:
        """Add a measurement that was not asked for (e.g. a result known before the search)."""
        import optuna

        trial = optuna.trial.create_trial(params=self._encode(point), distributions=self._distributions,
                                          value=float(score))
        self._study.add_trial(trial)
