"""The search under tuner_type "predictive": one model over every stage, launching only what could win.

Candidates are every stage at the geometric sizes (ladder_sizes) the memory model lets run.
The results already measured (the profile launches) are told first; then the tuner asks for
the candidate with the highest launch bound (tuners/predictive.py), and the search stops when
even that bound cannot beat the best measured by the worthwhile gain. The memory model is refitted after every launch (the
orchestrator's `fits`), so a candidate it no longer lets run is dropped before it is asked.
Nothing is launched here: `evaluate` does that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autotuner.tuning.memory.estimate import engine_family
from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.space.records import Reason, TrialResult, TrialState
from autotuner.tuning.searches.stage_search import (FailedVariants, not_memory_bound, variant_measured, variant_of,
                                     OffloadFallback, PredictedLargest, _always_fits, _no_fallback, prune_variant,
                                     beyond_previous_variant, search_finishes, search_knobs, stage_space_for)
from autotuner.tuning.space.search_space import (Evaluate, Fits, SearchPolicy, SearchSpace, fitting_micro_batch_sizes,
                                           ladder_sizes)
from autotuner.tuning.space.experiment import Experiment, Knobs
from autotuner.tuning.trials.evaluator import open_tuner_trials
from autotuner.tuning.trials.ledger import TunerTrials
from autotuner.tuning.tuners import drive
from autotuner.tuning.models.cost_model import Prediction
from autotuner.tuning.tuners.predictive import PredictiveTuner


@dataclass(frozen=True)
class PredictedCandidate:
    """One candidate as the model saw it: at its launch (launched) or at the end of the search."""

    experiment: Experiment
    prediction: Prediction
    launched: bool
    ruled_out_by: Reason | None = None  # when never launched: the prediction, the refitted memory model, ...
    why: str = ""  # when launched: why the search asked for it


@dataclass(frozen=True)
class PredictiveOutcome:
    results: tuple[TrialResult, ...]
    at_launch: tuple[PredictedCandidate, ...]  # the prediction each launch was made on
    final: tuple[PredictedCandidate, ...]  # every candidate, predicted from all results


def candidate_space(space: SearchSpace, predicted_largest: PredictedLargest, fits: Fits,
                    prune: Callable[..., None], offload_fallback: OffloadFallback,
                    report: Callable[[str], None]) -> list[Experiment]:
    """Every stage (and variant of it) at its ladder sizes (or the user's fixed sizes) that the
    memory model lets run; a variant only above the sizes the stage reaches without it."""
    candidates: list[Experiment] = []
    for stage in sorted(space.stages):
        reached = 0
        for variant in space.variants_for(stage):
            settled = stage_space_for(space, stage, predicted_largest, prune, offload_fallback, report, variant)
            if settled is None:
                continue
            stage_space, predicted = settled
            searched = beyond_previous_variant(stage_space, stage, variant, predicted, reached, prune)
            reached = max(reached, predicted)
            if searched is None:
                continue
            candidates += _rung_candidates(searched, stage, variant, predicted, fits, prune)
    return candidates


def _rung_candidates(space: SearchSpace, stage: int, variant: Knobs, predicted: int, fits: Fits,
                     prune: Callable[..., None]) -> list[Experiment]:
    if space.fixed_micro_batch_sizes:
        sizes = space.valid_micro_batch_sizes(space.max_micro_batch_size)
    else:
        sizes = ladder_sizes(fitting_micro_batch_sizes(space, stage, predicted, fits))
        # Micro-batch 1 pays a micro-step's fixed cost for every sample: only when memory leaves nothing else.
        sizes = [m for m in sizes if m > 1] or sizes
    candidates = [c for c in (space.experiment(stage, m) for m in sizes) if fits(c)]
    if not candidates:
        prune_variant(prune, stage, variant, Reason.MEMORY_MODEL,
                      "memory model, with the peaks measured so far: no micro-batch fits")
    return candidates


EXTRAPOLATION_LIMIT = 4  # no launch this many times beyond its engine's largest measured micro-batch


class _SearchedPredictive(PredictiveTuner):
    """The predictive tuner as the search drives it: before each ask the refitted memory model
    drops what it no longer lets run, the prediction each launch is asked on is kept, and the stop
    rule is trusted only once one of its predictions was checked by a launch (fitted on the profile
    alone, it has never been tested)."""

    def __init__(self, candidates: list[Experiment], policy: SearchPolicy, context: CostContext, fits: Fits,
                 search_space: SearchSpace, on_ask: Callable[[Experiment, Prediction], None] = lambda e, p: None,
                 family: Callable[[int], str] = engine_family, trials: TunerTrials | None = None):
        super().__init__(candidates, policy.objective, policy.seed, context, trials=trials)
        self.family = family  # the engine family of a stage (DDP, FSDP2, ...): whose measured sizes count
        self.on_ask = on_ask  # told each launch's prediction before it is launched (the history keeps it)
        self.fits = fits
        self.failed = FailedVariants(search_space, self._measured)  # from what it was told and shown
        self.search_space = search_space
        self.stands_for: dict[Experiment, Experiment] = {}  # a variant's first launch: its most promising size
        self.stand_in_kind: dict[Experiment, str] = {}  # why a stand-in went first
        self.asked: list[PredictedCandidate] = []
        # A prior from earlier runs was already checked against this run's profile launches.
        self.checked = bool(context.prior)

    def ask(self) -> Experiment | None:
        running = self.pending  # a copy; telling a refusal below does not change it
        for candidate in self.space:
            if candidate in self.results or candidate in running:
                continue
            refused = self.failed.refusal(candidate) or self._not_memory_bound(candidate)
            if refused is not None:  # its variant failed, or cannot pay at its stage
                self.tell(refused)
            elif not self.fits(candidate):
                self.tell(TrialResult(candidate, TrialState.PRUNED, error=Reason.MEMORY_REFITTED.value,
                                      reason=Reason.MEMORY_REFITTED))
        experiment = super().ask()
        if experiment is not None:
            prediction = self.predict(experiment)
            self.asked.append(PredictedCandidate(experiment, prediction, launched=True, why=self._why(experiment)))
            self.on_ask(experiment, prediction)
        return experiment

    def _why(self, experiment: Experiment) -> str:
        """One line for the summary: what made this launch worth its time."""
        target = self.stands_for.get(experiment, experiment)
        prediction = self.predict(target)
        bound = self.launch_bound(target)
        incumbent = self.best
        if incumbent is None:
            why = f"first launch: predicted {prediction.value:.4g}"
        else:
            why = (f"predicted {prediction.value:.4g}, at best {bound:.4g}, against {incumbent.value:.4g} "
                   f"measured ({incumbent.name})")
        if target != experiment:
            why = f"{self.stand_in_kind.get(experiment, 'stands in')} for {target.name}, which is " + why
        if not self.checked:
            why += "; no prediction checked by a launch yet, so none is trusted to rule it out"
        return why

    def _choose(self, untried: list[Experiment]) -> Experiment:
        """A later variant waits for its stage's curve without it (two sizes measured), so the model
        can rule it out. A variant never launched is launched first at its smallest size
        (stage_search.py `first_of_variant`), standing in for its most promising candidate: that one's
        bound decides whether it is worth launching at all."""
        waiting = set()
        for candidate in untried:
            stage = candidate.zero_stage
            if variant_of(self.search_space, candidate) and len(self._first_variant_sizes(stage)) < 2 and any(
                    c.zero_stage == stage and not variant_of(self.search_space, c) for c in untried):
                waiting.add(candidate)
        chosen = super()._choose([c for c in untried if c not in waiting] or untried)
        variant = variant_of(self.search_space, chosen)
        if variant and not variant_measured(self._measured(), self.search_space, variant):
            smallest = min((c for c in untried if variant_of(self.search_space, c) == variant),
                           key=lambda c: (c.micro_batch_size, c.zero_stage))
            if smallest != chosen:
                self.stands_for[smallest] = chosen
                self.stand_in_kind[smallest] = "its variant's first launch, at its smallest size,"
                return smallest
        return self._stepping_stone(chosen, untried)

    def _stepping_stone(self, chosen: Experiment, untried: list[Experiment]) -> Experiment:
        """A candidate more than EXTRAPOLATION_LIMIT x beyond the largest micro-batch its engine has
        measured is not launched before a size in between: the largest such candidate of the same
        stage and knobs goes first, standing in for it (its bound still decides whether it is
        worth a launch). Peaks far from every measured size were predicted several percent short
        (issue 49); each stepping stone refits the memory line closer to them."""
        family = self.family(chosen.zero_stage)
        measured = [r.experiment.micro_batch_size for r in self._measured() if r.state is TrialState.OK
                    and r.measured_memory_bytes and self.family(r.experiment.zero_stage) == family]
        if not measured or chosen.micro_batch_size <= EXTRAPOLATION_LIMIT * max(measured):
            return chosen
        reach = EXTRAPOLATION_LIMIT * max(measured)
        between = [c for c in untried if c.zero_stage == chosen.zero_stage and c.knobs == chosen.knobs
                   and max(measured) < c.micro_batch_size <= reach]
        if not between:
            return chosen  # no candidate in between to measure first: the refitted line is all there is
        stone = max(between, key=lambda c: c.micro_batch_size)
        self.stands_for[stone] = self.stands_for.get(chosen, chosen)
        self.stand_in_kind[stone] = (f"stepping stone (at most {EXTRAPOLATION_LIMIT}x past micro-batch "
                                     f"{max(measured)}, the largest its engine measured)")
        return stone

    def _not_memory_bound(self, candidate: Experiment) -> TrialResult | None:
        """A later variant's candidate where its stage's best without it is below the largest size
        the stage reaches without it (variant_rules.py `not_memory_bound`)."""
        if not variant_of(self.search_space, candidate):
            return None
        stage = candidate.zero_stage
        first = [c for c in self.space if c.zero_stage == stage and not variant_of(self.search_space, c)]
        if not first:
            return None
        measured = [r for r in self._measured() if r.experiment in first]
        reason = not_memory_bound(self.objective, stage, measured)
        return TrialResult(candidate, TrialState.PRUNED, error=reason, reason=Reason.NOT_MEMORY_BOUND) if reason else None

    def _first_variant_sizes(self, stage: int) -> set[int]:
        """Micro-batch sizes the stage ran under its first variant: a later variant (which only buys
        larger sizes, at the price of time) waits for that curve, so the model can rule it out."""
        return {r.experiment.micro_batch_size for r in self._measured()
                if r.experiment.zero_stage == stage and r.state is TrialState.OK
                and not variant_of(self.search_space, r.experiment)}

    def tell(self, result: TrialResult) -> None:
        self.checked = self.checked or result.experiment in self.pending
        super().tell(result)

    def could_improve(self, experiment: Experiment) -> bool:
        return not self.checked or super().could_improve(self.stands_for.get(experiment, experiment))


def ruled_out_by(told: TrialResult | None) -> Reason | None:
    """What ruled a candidate out, from what its tuner was told (None where it was launched): never
    told, the predictions; told pruned, the refitted memory model or the variant rules."""
    if told is None:
        return Reason.PREDICTION
    if told.state is not TrialState.PRUNED:
        return None
    return Reason.MEMORY_REFITTED if told.reason is Reason.MEMORY_REFITTED else Reason.VARIANT_RULES


def run_predictive_search(space: SearchSpace, policy: SearchPolicy, predicted_largest: PredictedLargest,
                          evaluate: Evaluate, prune: Callable[..., None], context: CostContext,
                          known: list[TrialResult], fits: Fits = _always_fits,
                          offload_fallback: OffloadFallback = _no_fallback,
                          report: Callable[[str], None] = lambda line: None,
                          on_ask: Callable[[Experiment, Prediction], None] = lambda e, p: None,
                          family: Callable[[int], str] = engine_family) -> PredictiveOutcome:
    """The candidates' search through the one driver (tuners/base.py `drive`): an evaluate with
    `capacity` slots (a Ray cluster) gets the k most optimistic bounds at once."""
    candidates = candidate_space(space, predicted_largest, fits, prune, offload_fallback, report)
    tuner = _SearchedPredictive(candidates, policy, context, fits, space, on_ask, family,
                                open_tuner_trials(evaluate, "every stage's candidates, one step-time model"))
    for result in known:
        if result.experiment not in tuner.results:
            tuner.observe(result)
    results = drive(tuner, evaluate, early_stopping=max(1, policy.num_trials), max_trials=policy.num_trials,
                    trust_predictions=True)
    launched = {r.experiment for r in results}
    at_launch = [c for c in tuner.asked if c.experiment in launched]
    final = [PredictedCandidate(candidate, tuner.predict(candidate), ruled_out_by(tuner.results.get(candidate)) is None,
                                ruled_out_by(tuner.results.get(candidate))) for candidate in tuner.space]
    by_prediction = sum(1 for c in final if c.ruled_out_by is Reason.PREDICTION)
    by_memory = sum(1 for c in final if c.ruled_out_by is Reason.MEMORY_REFITTED)
    report(f"predictive: {len(results)} launched after the profile; of {len(final)} candidates, prediction "
           f"ruled out {by_prediction} and the refitted memory model {by_memory}")
    everything = [r for r in tuner.results.values() if r.state is not TrialState.PRUNED]
    if not policy.fast:
        results += search_knobs(space, policy, everything, evaluate, fits=fits)
    measured = {r.experiment: r for r in everything + results}  # the knobs' results joined, once each
    results += search_finishes(space, policy, list(measured.values()), evaluate, fits=fits, report=report)
    return PredictiveOutcome(tuple(results), tuple(at_launch), tuple(final))
