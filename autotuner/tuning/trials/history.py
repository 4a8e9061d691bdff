"""The tuning history: every launch, whatever the tuner or backend, is also a trial of an optuna
study in optuna's RDB storage (SQLite at <results_dir>/history.db unless autotuning.storage names
another SQLAlchemy URL), so runs can be compared across time, and viewed with optuna-dashboard.

- One study per workload: its name holds the script's name and a hash of the run's fingerprint
  (script, arguments, config, ranks, torch, device), which the study's user attributes spell out.
- A trial's params are the experiment's dimensions; its user attributes what was measured and
  predicted before the launch (throughput, latency, memory; the predictive tuner's metric and
  its range), the phase and the error.
- The file journal stays the source of truth for resuming. A storage that is locked, unreachable
  or of a newer schema gets one line, and tuning goes on without it: nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from autotuner.tuning.space import dimensions
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

HISTORY_FILE = "history.db"
STUDY_PREFIX = "autotuner"
SQLITE_WAIT_S = 2.0  # a locked SQLite file is given up on quickly: the journal holds everything
LARGEST = 1 << 30  # the params' bounds: wide, fixed, so every run's trials share a distribution
LARGEST_NUMBER = 1e15


def default_url(results_dir: Path) -> str:
    return f"sqlite:///{(Path(results_dir) / HISTORY_FILE).resolve()}"


def study_name(fingerprint: Fingerprint) -> str:
    digest = hashlib.sha256(json.dumps(fingerprint.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{STUDY_PREFIX}:{Path(fingerprint.script).name}:{digest}"


def _engine_kwargs(url: str) -> dict[str, Any]:
    return {"connect_args": {"timeout": SQLITE_WAIT_S}} if url.startswith("sqlite") else {}


def open_storage(url: str):
    """optuna's RDB storage at `url`; raises what optuna and SQLAlchemy raise."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _distribution(name: str, value: Any):
    """A fixed distribution per param (optuna refuses a param whose kind changes within a study):
    the batch triad as integers on a log scale, numeric dimensions as floats over a fixed wide
    range (DeepSpeed configs write 5e8 as often as 500000000), the rest categorical over every
    value the registry knows."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if name == "zero_stage":
        return IntDistribution(0, 3)
    if name in ("micro_batch_size", "gradient_accumulation_steps", "tensor_parallel", "pipeline", "stages_per_rank"):
        return IntDistribution(1, LARGEST, log=True)
    known = dimensions.REGISTRY.get(name)
    choices = {v for d in (known.values.values() if known else ()) for per_stage in d.values() for v in per_stage}
    if all(_number(c) for c in choices | {value}):
        return FloatDistribution(0.0, LARGEST_NUMBER)
    return CategoricalDistribution(sorted(choices | {value}, key=repr))


def _param(distribution, value: Any) -> Any:
    from optuna.distributions import FloatDistribution

    return float(value) if isinstance(distribution, FloatDistribution) else value


class History:
    """Writes each result of one tuning run into its study; off for good after the first failure."""

    def __init__(self, url: str, fingerprint: Fingerprint, objective: Objective, tuner_type: str,
                 report: Callable[[str], None]):
        self.url = url
        self.study_name = study_name(fingerprint)
        self.fingerprint = fingerprint
        self._objective = objective
        self._tuner_type = tuner_type
        self._report = report
        self._study = None
        self._off = False
        self._started = time.time()
        self.recorded = 0

    def _open(self):
        import optuna

        direction = "minimize" if self._objective.metric == "latency" else "maximize"
        study = optuna.create_study(storage=open_storage(self.url), study_name=self.study_name,
                                    direction=direction, load_if_exists=True)
        study.set_user_attr("fingerprint", self.fingerprint.to_json())
        study.set_user_attr("metric", self._objective.metric)
        with warnings.catch_warnings():  # experimental in some optuna releases; the name is what the dashboard shows
            warnings.simplefilter("ignore")
            study.set_metric_names([f"{self._objective.metric} ({self._objective.unit})"])
        return study

    def record(self, result: TrialResult, phase: str, prediction=None) -> None:
        """One launch's result; `prediction` (tuners/predictive.py Prediction): what the
        predictive tuner expected of it when it asked for it."""
        if self._off:
            return
        try:
            if self._study is None:
                self._study = self._open()
            self._study.add_trial(self._trial(result, phase, prediction))
            self.recorded += 1
        except Exception as err:  # noqa: BLE001 - any storage failure: the journal holds everything
            self._off = True
            detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            self._report(f"history: not recorded from here on ({type(err).__name__}: {detail}) at {self.url}; "
                         "every result is still in the experiments' exp.json files")

    def record_signature(self, signature) -> None:
        """The workload's signature (tuning/models/transfer.py), by which later runs find this one."""
        if self._off or self._study is None:
            return
        try:
            self._study.set_user_attr("signature", signature.to_json())
        except Exception as err:  # noqa: BLE001
            self._off = True
            self._report(f"history: the workload signature was not recorded ({type(err).__name__}) at {self.url}")

    def prior_runs(self, signature) -> list:
        """Similar earlier runs in this storage (tuning/models/transfer.py); none, with one line, when it
        cannot be read."""
        from autotuner.tuning.models.transfer import load_prior_runs

        if self._off:
            return []
        try:
            return load_prior_runs(open_storage(self.url), signature, self.study_name)
        except Exception as err:  # noqa: BLE001 - transfer is an optimisation: tune cold instead
            self._report(f"transfer: earlier runs not read ({type(err).__name__}) at {self.url}; tuning cold")
            return []

    def record_late_noise(self, late: dict) -> None:
        """The gradient noise scale the pick's training run read last (its batch ramp's), for the
        next tune of the same model family's goodput."""
        if self._off:
            return
        try:
            if self._study is None:
                self._study = self._open()
            self._study.set_user_attr("late_noise_scale", late)
        except Exception as err:  # noqa: BLE001
            self._off = True
            self._report(f"history: the late noise scale was not recorded ({type(err).__name__}) at {self.url}")

    def late_noise_scale(self, signature) -> tuple[float, str, int] | None:
        """The latest B_noise a similar earlier run's training read (same model family, engine,
        device, ranks and precision): (B_noise, its study, the step), or None."""
        if self._off:
            return None
        try:
            from autotuner.tuning.models.transfer import load_late_noise

            return load_late_noise(open_storage(self.url), signature, self.study_name)
        except Exception as err:  # noqa: BLE001 - an optimisation: the profile's B_noise stands
            self._report(f"goodput: earlier runs' noise scales not read ({type(err).__name__}) at {self.url}")
            return None

    def record_pick(self, best: TrialResult | None) -> None:
        """The run's final pick (after re-measuring, the best median: not optuna's best single
        trial), kept on the study for `launcher --history`."""
        if self._off or self._study is None:
            return
        try:
            self._study.set_user_attr("pick", {"name": best.name, "value": best.value, "unit": self._objective.unit}
                                      if best is not None else None)
            self._study.set_user_attr("last_run_unix", self._started)
        except Exception as err:  # noqa: BLE001
            self._off = True
            self._report(f"history: the pick was not recorded ({type(err).__name__}) at {self.url}")

    def _trial(self, result: TrialResult, phase: str, prediction=None):
        import optuna

        experiment = result.experiment
        params: dict[str, Any] = {"zero_stage": experiment.zero_stage, "micro_batch_size": experiment.micro_batch_size,
                                  "gradient_accumulation_steps": experiment.gradient_accumulation_steps}
        params.update(dict(experiment.knobs))
        if experiment.tensor_parallel:
            params["tensor_parallel"] = experiment.tensor_parallel
        if experiment.pipeline:
            params["pipeline"] = experiment.pipeline
        if experiment.stages_per_rank > 1:
            params["stages_per_rank"] = experiment.stages_per_rank
        measurement = result.measurement
        attrs = {
            "name": result.name, "state": result.state.value, "phase": phase, "tuner_type": self._tuner_type,
            "metric": self._objective.metric, "unit": self._objective.unit,
            "throughput": measurement.throughput if measurement else None,
            "latency": measurement.latency if measurement else None,
            "engine": measurement.engine if measurement else None,
            "measured_memory_bytes": result.measured_memory_bytes,
            "predicted_memory_bytes": result.predicted_memory_bytes,
            "wall_time_s": result.wall_time_s, "error": result.error, "run_started_unix": self._started,
            "predicted_metric": prediction.value if prediction else None,
            "predicted_metric_low": prediction.low if prediction else None,
            "predicted_metric_high": prediction.high if prediction else None,
        }
        ok = result.state is TrialState.OK and result.value is not None
        distributions = {name: _distribution(name, value) for name, value in params.items()}
        return optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL,
            value=float(result.value) if ok else None,
            params={name: _param(distributions[name], value) for name, value in params.items()},
            distributions=distributions, user_attrs=attrs)


def make_history(tuning, results_dir: Path, fingerprint: Fingerprint, objective: Objective,
                 report: Callable[[str], None]) -> History | None:
    """The run's history, or None: off in the config, or optuna not installed (then one line, only
    when the user named a storage)."""
    if not tuning.history:
        return None
    try:
        import optuna  # noqa: F401
    except ImportError:
        if tuning.storage:
            report(f"history: autotuning.storage {tuning.storage} is not written: optuna is not installed "
                   "(pip install 'autotuner[history]')")
        return None
    return History(tuning.storage or default_url(results_dir), fingerprint, objective, tuning.tuner_type, report)
