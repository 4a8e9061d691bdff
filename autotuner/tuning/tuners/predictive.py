"""tuner_type "predictive": launch only what a fitted throughput model says could beat the best.

The step-time model (cost_model.py) is refitted on every result. Each untried candidate gets a
launch bound (`launch_bound`): the most its true value could plausibly be against the best
measured, from the model's joint posterior over the two true steps. What the pair shares (the
slope, a group's offset) cancels, the best's own lucky window is shrunk toward its neighbours,
and no launch's noise is added: a candidate that could beat the best only by measuring high
would bring a tie, not a better config. `ask` returns the candidate with the highest bound, and
`could_improve` says whether it beats the best by more than the worthwhile gain (NOISE_FLOOR).
The search stops when it does not (drive(..., trust_predictions=True)); asked further, the tuner
still orders the rest, so it meets the same contract as every tuner. `predict` keeps a launch's
noise: it says what a launch would measure (the summary's predicted range).

Launches outside the candidates (the profile's micro-batch 1, which no candidate repeats) are
`observe`d: fitted and weighed as the best so far, never asked for. Left out, the fit had no point
near a micro-step's fixed cost, put it at zero, and predicted micro-batch 2 tens of times faster
than micro-batch 1 had measured: a launch no model of the step could have put ahead (issue 49).

Similar earlier runs' steps (transfer, the context's prior) narrow the model, but may only rule a
candidate out: one that this run's own results alone rule out is neither asked for first nor
launched on the prior's word. A prior that flatters a candidate (a model four times wider than
the earlier run's, say) then costs no launch that a tune without it would not make.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Mapping, Sequence

from autotuner.tuning.models.cost_model import (BOUND_Z, NOISE_FLOOR, CostContext, Observation, Prediction,
                                                StepTimeModel, StepTimePrediction)
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.trials.ledger import TunerTrials
from autotuner.tuning.tuners.base import Tuner


class PredictiveTuner(Tuner):
    def __init__(self, space: Sequence[Experiment], objective: Objective, seed: int = 0,
                 context: CostContext | None = None, worthwhile_gain: float = NOISE_FLOOR,
                 trials: TunerTrials | None = None):
        super().__init__(space, objective, seed, trials)
        self.context = context or CostContext()
        self.worthwhile_gain = worthwhile_gain  # relative: the least gain a launch must be able to bring
        self._largest = max((e.micro_batch_size for e in self.space), default=1)
        self._models: dict[bool, tuple[int, StepTimeModel]] = {}  # with the prior or not: (results, model)

    def observe(self, result: TrialResult) -> None:
        """A result outside the space: the model and the best so far count it."""
        if result.experiment in self.space:
            self.tell(result)
        else:
            self.trials.observe(result)

    @property
    def observed(self) -> Mapping[Experiment, TrialResult]:
        """Measured, outside the candidates."""
        return self.trials.observed

    def _measured(self) -> list[TrialResult]:
        return [*self.observed.values(), *self.results.values()]

    # ----- the objective <-> step time -----
    def _samples_per_step(self, experiment: Experiment) -> int:
        return experiment.train_batch_size(max(1, self.context.world_size))

    def _step_time(self, result: TrialResult) -> float | None:
        if result.state is not TrialState.OK or result.value is None or result.value <= 0:
            return None
        measurement = result.measurement
        if measurement is not None and measurement.latency and measurement.latency > 0:
            return float(measurement.latency)
        if self.objective.metric == "latency":
            return float(result.value)
        samples = self._samples_per_step(result.experiment)
        return samples * self.objective.efficiency(samples) / float(result.value)

    def _flops_per_sample(self) -> float:
        ratios = [r.value * t / self._samples_per_step(r.experiment) for r in self._measured()
                  if (t := self._step_time(r)) is not None]
        return statistics.median(ratios) if ratios else 1.0

    def _value(self, experiment: Experiment, step_time_s: float) -> float:
        if self.objective.metric == "latency":
            return step_time_s
        samples = self._samples_per_step(experiment)
        samples_per_s = samples / step_time_s
        if self.objective.metric == "FLOPS":
            return samples_per_s * self._flops_per_sample()
        return samples_per_s * self.objective.efficiency(samples)  # goodput: weighed by its global batch

    # ----- the model -----
    def model(self, with_prior: bool = True) -> StepTimeModel:
        """The step-time model fitted on every result so far, with the earlier runs' scaled steps
        (transfer) unless `with_prior` is False."""
        measured = self._measured()
        cached = self._models.get(with_prior)
        if cached is None or cached[0] != len(measured):
            observations = list(self.context.prior) if with_prior else []
            for result in measured:
                step_time = self._step_time(result)
                if step_time is None:
                    continue
                observations.append(Observation(result.experiment, step_time, result.relative_error))
            cached = self._models[with_prior] = (len(measured), StepTimeModel(observations, self.context,
                                                                               self._largest))
        return cached[1]

    def step_floor_s(self, experiment: Experiment) -> float:
        """The least step time `experiment` can take, whatever the model says: a step of the same
        stage and knobs with no more micro-steps, each no larger, was measured, and more samples
        take no less time (less that measurement's noise). 0 when nothing bounds it."""
        floor = 0.0
        for result in self._measured():
            other = result.experiment
            if (other.zero_stage, other.knobs) != (experiment.zero_stage, experiment.knobs) or \
                    other.micro_batch_size > experiment.micro_batch_size or \
                    other.gradient_accumulation_steps > experiment.gradient_accumulation_steps:
                continue
            step_time = self._step_time(result)
            if step_time is not None:
                noise = max(NOISE_FLOOR, result.relative_error or 0.0)
                floor = max(floor, step_time * (1 - BOUND_Z * noise))
        return floor

    def measured_step(self, result: TrialResult) -> float | None:
        """A result's step time in seconds, as the model is fitted on it (None: not measured)."""
        return self._step_time(result)

    def predicted_step(self, experiment: Experiment, with_prior: bool = True) -> StepTimePrediction:
        """What a launch of `experiment` would measure as its step, floored as `predict` floors it."""
        step = self.model(with_prior).predict(experiment)
        return dataclasses.replace(step, mean_s=max(step.mean_s, self.step_floor_s(experiment)))

    def predict(self, experiment: Experiment, with_prior: bool = True) -> Prediction:
        step = self.model(with_prior).predict(experiment)
        fastest, slowest = step.bounds()
        floor = self.step_floor_s(experiment)
        fastest, slowest = max(fastest, floor), max(slowest, floor)
        step = dataclasses.replace(step, mean_s=max(step.mean_s, floor))
        at_fastest, at_slowest = self._value(experiment, fastest), self._value(experiment, slowest)
        return Prediction(self._value(experiment, step.mean_s), min(at_fastest, at_slowest),
                          max(at_fastest, at_slowest))

    def launch_bound(self, experiment: Experiment, with_prior: bool = True,
                     incumbent: TrialResult | None = None) -> float:
        """The best value `experiment` could plausibly have, judged against the best measured (or
        `incumbent`), in the objective's units: the incumbent's value times the plausible ratio of
        the two, from the model's uncertainty about the difference between their true steps, not a
        launch's noise. A launch that could beat the best only by a lucky window would bring a
        tie, not a better config."""
        incumbent = incumbent if incumbent is not None else self.best
        if incumbent is None:
            prediction = self.predict(experiment, with_prior)
            return prediction.high if self.objective.maximize else prediction.low
        pair = self.model(with_prior).compare(experiment, incumbent.experiment)
        fastest_s = pair.candidate_s * max(1 - BOUND_Z * pair.relative_std, 0.1)  # as StepTimePrediction.bounds
        bound = incumbent.value * self._value(experiment, fastest_s) / self._value(incumbent.experiment,
                                                                                  pair.incumbent_s)
        floor = self.step_floor_s(experiment)
        if floor > 0:  # no faster than a measured smaller step of its stage
            at_floor = self._value(experiment, floor)
            bound = min(bound, at_floor) if self.objective.maximize else max(bound, at_floor)
        return bound

    def _beats_best(self, value: float, incumbent: TrialResult | None = None) -> bool:
        """Whether an optimistic value beats the best measured (or `incumbent`) by more than the
        worthwhile gain."""
        incumbent = incumbent if incumbent is not None else self.best
        if incumbent is None:
            return True
        factor = 1 + self.worthwhile_gain if self.objective.maximize else 1 - self.worthwhile_gain
        return self.objective.better(value, incumbent.value * factor)

    def _ruled_out_without_prior(self, experiment: Experiment) -> bool:
        """With earlier runs' steps (transfer) in the model: whether this run's own results alone
        already rule `experiment` out. A prior may rule a candidate out, never back in, so a warm
        start launches nothing that a tune without it would have ruled out at the same point."""
        if not self.context.prior or self.best is None:
            return False
        return not self._beats_best(self.launch_bound(experiment, with_prior=False))

    def _choose(self, untried: list[Experiment]) -> Experiment:
        if not any(self._step_time(r) is not None for r in self._measured()):
            # Nothing measured yet: the lowest stage at its largest size (a model needs a point).
            return min(untried, key=lambda e: (e.zero_stage, -e.micro_batch_size, e.knobs))
        # The prior orders the candidates this run's own results leave open (all, if none is).
        untried = [e for e in untried if not self._ruled_out_without_prior(e)] or untried
        scored = [(self.launch_bound(e), index) for index, e in enumerate(untried)]
        best = max(scored) if self.objective.maximize else min(scored, key=lambda s: (s[0], -s[1]))
        return untried[best[1]]

    def could_improve(self, experiment: Experiment) -> bool:
        return self._beats_best(self.launch_bound(experiment)) and not self._ruled_out_without_prior(experiment)

    def rules_out(self, result: TrialResult, incumbent: TrialResult) -> bool:
        """Whether the model, with the prior or without it, says the measured `result` cannot beat
        `incumbent` by the worthwhile gain: the final pick's contenders, judged as launches are.
        Only where it reproduces both first measurements within the noise floor: a curve that
        misses one (a cliff the fitted shape cannot follow, say) would rule out by its own misfit."""
        models = (True, False) if self.context.prior else (True,)
        if not all(self._reproduces(measured, with_prior) for with_prior in models
                   for measured in (result, incumbent)):
            return False
        return not all(self._beats_best(self.launch_bound(result.experiment, with_prior, incumbent), incumbent)
                       for with_prior in models)

    def _reproduces(self, result: TrialResult, with_prior: bool) -> bool:
        """Whether the model predicts `result`'s first measured step within the noise floor."""
        told = self.results.get(result.experiment)
        step = self._step_time(told) if told is not None else None
        if step is None:
            return False
        return abs(self.model(with_prior).predict(told.experiment).mean_s / step - 1) <= NOISE_FLOOR


def pooled_rule(results: Sequence[TrialResult], objective: Objective,
                context: CostContext) -> Callable[[TrialResult, TrialResult], bool]:
    """`PredictiveTuner.rules_out` over a model fitted on every measured result: for the final pick,
    whose single measurements it pools (a lucky window of the best is shrunk toward the
    neighbours that contradict it; a contender's unlucky one is too)."""
    measured = [r for r in results if r.state is TrialState.OK and r.value is not None]
    tuner = PredictiveTuner(list(dict.fromkeys(r.experiment for r in measured)), objective, context=context)
    for result in measured:
        if result.experiment not in tuner.results:
            tuner.tell(result)
    return tuner.rules_out
