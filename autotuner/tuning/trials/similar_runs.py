"""Similar earlier runs, as one tuning run asks the history for them (transfer.py scales them).

Once, after the whole profile: the step-time model's prior, each earlier run checked against the
profile's launches. (The profile's sizes are a cold run's: a prior checked against one launch
does not choose them.) The workload's signature is recorded on the run's study either way; only
tuner_type predictive with autotuning.transfer reads priors. Nothing is launched here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autotuner.tuning.models.cost_model import CostContext, Observation
from autotuner.tuning.trials.history import History
from autotuner.tuning.memory.estimate import ModelProfile
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.models.transfer import (PriorRun, TransferPrior, WorkloadSignature, signature_of,
                                       transfer_prior)


def _observations(results: list[TrialResult]) -> list[Observation]:
    return [Observation(r.experiment, r.measurement.latency) for r in results
            if r.state is TrialState.OK and r.measurement is not None and r.measurement.latency > 0]


@dataclass(frozen=True)
class SimilarRuns:
    history: History | None
    enabled: bool  # tuner_type predictive and autotuning.transfer

    def _signature(self, profile: ModelProfile, profile_results: list[TrialResult]) -> WorkloadSignature | None:
        info = next((r.model_info for r in profile_results if r.model_info is not None), None)
        if self.history is None or info is None or not self.history.recorded:
            return None
        return signature_of(info, profile.engine, profile.activation_bytes_per_sample, profile_results)

    def _priors(self, signature: WorkloadSignature) -> list[PriorRun]:
        return self.history.prior_runs(signature) if self.enabled else []

    def late_noise(self, profile: ModelProfile, profile_results: list[TrialResult]) -> tuple[float, str, int] | None:
        """The B_noise a similar earlier run's training read last (its batch ramp's), or None."""
        signature = self._signature(profile, profile_results)
        return self.history.late_noise_scale(signature) if signature is not None else None

    def prior(self, profile: ModelProfile, profile_results: list[TrialResult], context: Callable[[], CostContext],
              report: Callable[[str], None]) -> TransferPrior:
        """The signature goes on the run's study; the priors, each checked against the profile
        launches, become the step-time model's prior."""
        signature = self._signature(profile, profile_results)
        if signature is None:
            return TransferPrior()
        self.history.record_signature(signature)
        priors = self._priors(signature)
        if not priors:
            return TransferPrior()
        return transfer_prior(priors, signature, context(), _observations(profile_results), report)
