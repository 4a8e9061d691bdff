"""Similar earlier runs, as one tuning run asks the history for them (transfer.py scales them).

Twice: after the profile's first launch, where the second should go (the size they predict
fastest); and after the whole profile, the step-time model's prior. The workload's signature is
recorded on the run's study either way; only tuner_type predictive with autotuning.transfer reads
priors. Nothing is launched here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autotuner.tuning.models.cost_model import CostContext, Observation
from autotuner.tuning.trials.history import History
from autotuner.tuning.memory.estimate import ModelProfile
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.models.transfer import (PriorRun, TransferPrior, WorkloadSignature, prior_best, signature_of,
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

    def second_size(self, profile: ModelProfile, first: TrialResult, candidates: list[Experiment],
                    context: Callable[[], CostContext], report: Callable[[str], None]) -> int | None:
        """The candidate size the priors, checked against the first profile launch alone, predict
        to run the most samples/s; None without a prior that survives the check."""
        signature = self._signature(profile, [first])
        measured = _observations([first])
        priors = self._priors(signature) if signature is not None and measured and candidates else []
        best = prior_best(priors, signature, context(), measured[0], candidates) if priors else None
        if best is None:
            return None
        report(f"profile: micro-batch {best.micro_batch_size} next, where similar earlier runs predict the "
               "most samples/s (transfer)")
        return best.micro_batch_size

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
