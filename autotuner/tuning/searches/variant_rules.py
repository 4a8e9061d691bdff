"""Rules for the dimensions searched beyond stage x micro-batch x gas (tuning/space/dimensions.py):
variants (activation checkpointing policies), searched beside their stage, and finishes
(compile), tried last on the best configurations. Shared by the grid search (stage_search.py) and
the predictive one (predictive_search.py); nothing here launches."""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from autotuner.tuning.space import dimensions
from autotuner.tuning.space.records import Objective, Reason, TrialResult, TrialState
from autotuner.tuning.space.search_space import Evaluate, Fits, SearchPolicy, SearchSpace
from autotuner.tuning.space.experiment import Experiment, Knobs


def _always_fits(experiment: Experiment) -> bool:
    return True


def variant_text(variant: Knobs) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant)


def prune_variant(prune: Callable[..., None], stage: int, variant: Knobs, reason: Reason, text: str) -> None:
    """`prune(stage, reason, text[, variant])`: a stage, or a variant of it, not searched (further)."""
    if variant:
        prune(stage, reason, f"{variant_text(variant)}: {text}", variant)
    else:
        prune(stage, reason, text)


def variant_of(space: SearchSpace, experiment: Experiment) -> Knobs:
    """The experiment's variant when it is not its stage's first (activation checkpointing "full",
    say), else ()."""
    variants = space.variants_for(experiment.zero_stage)
    names = {name for variant in variants for name, _ in variant}
    own = tuple(kv for kv in experiment.knobs if kv[0] in names)
    return () if not own or own == variants[0] else own


class FailedVariants:
    """Variants that failed other than by running out of memory: the script cannot run them (a
    model whose forward changes between the forward and the recompute, say), so no further size
    of them is launched, as a first launch's failure stops the whole run. It reads the failures
    from `results` (the ledger's), keeping none of its own."""

    def __init__(self, space: SearchSpace, results: Callable[[], Sequence[TrialResult]]):
        self.space = space
        self._results = results

    def refusal(self, experiment: Experiment) -> TrialResult | None:
        variant = variant_of(self.space, experiment)
        if not variant:
            return None
        first = next((r for r in self._results()
                      if r.state is TrialState.FAILED and variant_of(self.space, r.experiment) == variant), None)
        if first is None:
            return None
        return TrialResult(experiment, TrialState.PRUNED, error=f"{variant_text(variant)} failed in "
                           f"{first.name} (not out of memory): not launched again", reason=Reason.VARIANT_FAILED)


FINISH_TOP = 2  # at most this many of the best configurations are tried finished


def search_finishes(space: SearchSpace, policy: SearchPolicy, results: list[TrialResult], evaluate: Evaluate,
                    fits: Fits = _always_fits, top: int = FINISH_TOP,
                    report: Callable[[str], None] = lambda line: None) -> list[TrialResult]:
    """The finishing dimensions (compile) last, on the best configurations measured, best first:
    each with every other combination of the finishing values. They change speed, not what fits,
    so the search above needs none of them, and their one-off costs count through the objective.
    What finishing did to the best (its steady step's ratio, the one-off it added) predicts what
    it would do to the next: that is launched only where the prediction, with the measurements'
    slack, could beat the best so far (at most `top` configurations are tried)."""
    from autotuner.tuning.space.planned_run import FinishEffect, could_beat, predicted_finished_value

    objective = policy.objective
    ok = [r for r in results if r.state is TrialState.OK and r.value is not None]
    best_first = objective.rank(ok)
    finished: list[TrialResult] = []
    effects: dict[Knobs, FinishEffect] = {}  # per finishing combination, from the best it was tried on
    tried = 0
    for result in best_first:
        values = space.finishes.get(result.experiment.zero_stage, {})
        own = dict(result.experiment.knobs)
        if not values or any(own.get(name, vals[0]) != vals[0] for name, vals in values.items()):
            continue  # a finished configuration itself (compiled already)
        if tried == top:
            break
        names = sorted(values)
        best_so_far = objective.best(ok + finished)
        these = []
        for combo in itertools.product(*(values[n] for n in names)):
            knobs = tuple(zip(names, combo))
            if all(value == values[name][0] for name, value in knobs):
                continue  # the configuration as measured
            effect = effects.get(knobs)
            if effect is not None:
                predicted = predicted_finished_value(result, effect, objective, policy.planned_steps)
                if not could_beat(predicted, best_so_far.value, objective):
                    report(f"{variant_text(knobs)}: not tried on {result.name}: predicted {predicted:.4g} "
                           f"{objective.unit} from what it did to the best, which cannot beat {best_so_far.name} "
                           f"({best_so_far.value:.4g})")
                    continue
            candidate = result.experiment.with_knobs(dict(knobs))
            if fits(candidate):
                outcome = evaluate(candidate)
                these.append(outcome)
                if outcome.state is TrialState.OK and outcome.value is not None and knobs not in effects:
                    effects[knobs] = FinishEffect.measured(outcome, result)
        if these:
            tried += 1
        finished += these
        if not any(r.state is TrialState.OK and objective.better(r.value, result.value) for r in these):
            break  # finishing did not pay on this one: by the same ratio it will not on the next
    return finished


def not_memory_bound(objective: Objective, stage: int, results) -> str | None:
    """A later variant only buys larger micro-batches, so it can help only while the stage's
    throughput still rises with the micro-batch: the reason to skip it when a larger size than
    the stage's best was measured without it and did worse, else None."""
    ok = [r for r in results if r.experiment.zero_stage == stage and r.state is TrialState.OK]
    best = objective.best(ok)
    if best is None:
        return None
    larger = max(r.experiment.micro_batch_size for r in ok)
    if best.experiment.micro_batch_size >= larger:
        return None
    return (f"cannot help: without it the stage did best at {best.name}, below a larger micro-batch it "
            f"measured ({larger}), so larger micro-batches do not pay here")


def variant_measured(results, space: SearchSpace, variant: Knobs) -> bool:
    """Whether a launch of `variant` (at any stage) has run or run out of memory: its memory is
    then fitted on its own peaks."""
    return any(variant_of(space, r.experiment) == variant and r.state in (TrialState.OK, TrialState.OOM)
               for r in results)


def checkpointing_settled(space: SearchSpace, by_policy: dict[str, int], profiled: bool) -> tuple[SearchSpace, str | None]:
    """A tuned dimension that selects the activation figure (the checkpointing policy) is searched
    only where the profile measured that figure for each value; else every variant keeps its
    neutral value, and the line says why (the dimension's own reason)."""
    from dataclasses import replace

    selector = dimensions.activation_selector()
    if selector is None:
        return space, None
    name, neutral = selector.name, selector.neutral_value()
    if by_policy or not any(name in dict(v) for variants in space.variants.values() for v in variants):
        return space, None
    why = selector.unmeasured_reasons[0 if profiled else 1]
    # Kept at the neutral value rather than dropped: the profile launches already ran (and are named) so.
    kept = {stage: tuple(dict.fromkeys(tuple((k, neutral if k == name else v) for k, v in variant)
                                       for variant in variants))
            for stage, variants in space.variants.items()}
    return replace(space, variants=kept), (f"{dimensions.dotted(selector)}: not tuned: {why}; every experiment runs "
                                           "without it")
