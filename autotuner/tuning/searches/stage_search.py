"""The search over ZeRO stage × micro-batch × gas (and, in full mode, ZeRO knobs).

Experiments are measured through an injected `evaluate` (in `run_search`, through an evaluator
over it, evaluator.py: what was measured is not launched again, a failed variant is refused), so this module launches
nothing and can be tested with a fake. Order of work, per stage in 0..3:
1. prune what the memory model says cannot fit; a stage that fits no larger micro-batch than
   a lower one gets one probe at the best micro-batch so far, and is skipped unless it wins;
2. confirm the predicted largest micro-batch, bisecting down on OOM;
3. let the tuner pick among micro-batch candidates (each with its own gas);
then, in full mode, tune knobs on the best stages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Callable

from autotuner.tuning.trials.evaluator import Evaluator, evaluator_of, open_tuner_trials
from autotuner.tuning.space.records import Reason, TrialResult, TrialState
from autotuner.tuning.space.search_space import (Evaluate, Fits, SearchPolicy, SearchSpace, fitting_micro_batch_sizes,
                                           spread_micro_batch_sizes)
from autotuner.tuning.space.experiment import Knobs
from autotuner.tuning.tuners import drive, make_tuner
from autotuner.tuning.searches.variant_rules import (FailedVariants, _always_fits, not_memory_bound,  # noqa: F401
                                            prune_variant, search_finishes, variant_measured, variant_of,
                                            variant_text)

BISECTION_TOLERANCE = 0.1  # stop once the largest running and smallest failing sizes are this close


def confirm_largest(space: SearchSpace, stage: int, predicted: int, evaluate: Evaluate,
                    fits: Fits = _always_fits) -> tuple[int | None, list[TrialResult]]:
    """Run the predicted largest micro-batch; on OOM or failure bisect down geometrically over the
    sizes the memory model (refitted by `evaluate` after each launch) still lets run, until the
    bracket between a size that ran and one that failed is within BISECTION_TOLERANCE."""
    results: list[TrialResult] = []
    runs: int | None = None  # the largest size that ran
    fails: int | None = None  # the smallest size that failed
    while True:
        fitting = fitting_micro_batch_sizes(space, stage, predicted, fits)
        candidates = [m for m in fitting if (runs is None or m > runs) and (fails is None or m < fails)]
        if not candidates:
            break
        if runs is not None and fails is not None and fails <= runs * (1 + BISECTION_TOLERANCE):
            break
        if fails is None or max(fitting) < fails:
            # The model's largest: first as predicted, then as refitted on the failure (when the
            # refit no longer lets the failed size run).
            size = candidates[-1]
        else:
            middle = math.sqrt((runs or candidates[0]) * fails)
            size = min(candidates, key=lambda m: (abs(math.log(m) - math.log(middle)), m))
        results.append(evaluate(space.experiment(stage, size)))
        if results[-1].state is TrialState.OK:
            runs = size
            if fails is None:
                break
        else:
            fails = size
    return runs, results


def search_stage(space: SearchSpace, policy: SearchPolicy, stage: int, predicted: int, evaluate: Evaluate,
                 larger_than: int, fits: Fits = _always_fits) -> tuple[int | None, list[TrialResult]]:
    """Measure one stage; returns (its largest working micro-batch, results)."""
    if space.fixed_micro_batch_sizes:
        candidates = [space.experiment(stage, m) for m in space.valid_micro_batch_sizes(space.max_micro_batch_size)]
        candidates = [c for c in candidates if fits(c)]
        tuner = make_tuner(policy.tuner_type, candidates, policy.objective, policy.seed,
                           trials=open_tuner_trials(evaluate, f"ZeRO {stage}, the configured micro-batch sizes"))
        results = drive(tuner, evaluate, early_stopping=policy.early_stopping, max_trials=policy.num_trials)
        ok = [r.experiment.micro_batch_size for r in results if r.state is TrialState.OK]
        return (max(ok) if ok else None), results
    largest, results = confirm_largest(space, stage, predicted, evaluate, fits)
    if largest is None or largest <= larger_than:
        return largest, results  # nothing this stage can add over a lower one
    sizes = spread_micro_batch_sizes(fitting_micro_batch_sizes(space, stage, largest, fits), largest,
                                     space.num_micro_batch_sizes)
    tuner = make_tuner(policy.tuner_type, [space.experiment(stage, m) for m in sizes], policy.objective, policy.seed,
                       trials=open_tuner_trials(evaluate, f"ZeRO {stage}, micro-batch sizes"))
    for result in results:
        if result.experiment in tuner.space:
            tuner.tell(result)
    budget = max(0, policy.num_trials - len(results))
    results += drive(tuner, evaluate, early_stopping=policy.early_stopping, max_trials=budget)
    results += extend_edges(space, policy, stage, largest, results, evaluate, fits,
                            budget=max(0, policy.num_trials - len(results)))
    return largest, results


def next_size_beyond(space: SearchSpace, stage: int, edge: int, downward: bool, ceiling: int,
                     fits: Fits) -> int | None:
    """The valid size nearest to half (downward) or double `edge` beyond it, up to `ceiling`,
    that the memory model lets run, or None."""
    target = edge / 2 if downward else edge * 2
    beyond = [m for m in space.valid_micro_batch_sizes(ceiling)
              if (m < edge if downward else m > edge) and fits(space.experiment(stage, m))]
    if not beyond:
        return None
    return min(beyond, key=lambda m: (abs(math.log(m) - math.log(target)), m))


def extend_edges(space: SearchSpace, policy: SearchPolicy, stage: int, largest: int, results: list[TrialResult],
                 evaluate: Evaluate, fits: Fits, budget: int) -> list[TrialResult]:
    """While the stage's best is the smallest (or largest) size it tried, try the next size
    beyond it: the candidates (largest, ~half, ~quarter) need not bracket the optimum (on a CPU
    smaller is often faster per sample). Upward never passes the stage's confirmed largest size,
    the memory limit. Stops at the first size that does not improve."""
    extra: list[TrialResult] = []
    while len(extra) < budget:
        done = [r for r in results + extra if r.experiment.zero_stage == stage]
        ok = [r for r in done if r.state is TrialState.OK]
        best = policy.objective.best(ok)
        if best is None:
            return extra
        tried = {r.experiment.micro_batch_size for r in done}
        if len({r.experiment.micro_batch_size for r in ok}) < 2:
            return extra  # one size measured shows no trend (num_tuning_micro_batch_sizes 1, say)
        size = best.experiment.micro_batch_size
        downward = size == min(tried)
        if not downward and size != max(tried):
            return extra
        following = next_size_beyond(space, stage, size, downward, largest, fits)
        if following is None or following in tried:
            return extra
        result = evaluate(space.experiment(stage, following))
        extra.append(result)
        if result.state is not TrialState.OK or not policy.objective.better(result.value, best.value):
            return extra
    return extra


def knob_space(space: SearchSpace, stage: int) -> list[dict[str, Any]]:
    values = space.knob_values.get(stage, {})
    if not values:
        return []
    names = sorted(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]


def search_knobs(space: SearchSpace, policy: SearchPolicy, fast_results: list[TrialResult],
                 evaluate: Evaluate, top_stages: int = 2, top_micro: int = 2,
                 fits: Fits = _always_fits) -> list[TrialResult]:
    """Full mode: tune ZeRO knobs on the best stages, around their best micro-batch sizes."""
    objective = policy.objective
    by_stage: dict[int, list[TrialResult]] = {}
    for result in fast_results:
        if result.state is TrialState.OK:
            by_stage.setdefault(result.experiment.zero_stage, []).append(result)
    ranked = [r.experiment.zero_stage for r in objective.rank(objective.best(by_stage[s]) for s in by_stage)]
    results: list[TrialResult] = []
    for stage in ranked[:top_stages]:
        knobs = knob_space(space, stage)
        if not knobs:
            continue
        best_first = objective.rank(by_stage[stage])[:top_micro]
        candidates = [c for c in (r.experiment.with_knobs(k) for r in best_first for k in knobs) if fits(c)]
        if not candidates:
            continue
        tuner = make_tuner(policy.tuner_type, candidates, objective, policy.seed,
                           trials=open_tuner_trials(evaluate, f"ZeRO {stage}, knobs"))
        results += drive(tuner, evaluate, early_stopping=policy.early_stopping, max_trials=policy.num_trials)
    return results


# What the memory model offers for a stage (with a variant's knobs) that fits nothing as
# configured: the knobs that make it fit (CPU offload) and the largest micro-batch with them, or None.
OffloadFallback = Callable[[int, Knobs], "tuple[dict[str, Any], int] | None"]
# The memory model's largest micro-batch: per stage (key `stage`) and per stage and variant
# (key `(stage, variant)`, for a variant other than ()); 0 when not even the states fit.
PredictedLargest = dict[Any, int]


def _no_fallback(stage: int, variant: Knobs = ()) -> None:
    return None


def largest_for(predicted_largest: PredictedLargest, stage: int, variant: Knobs, default: int) -> int:
    key = (stage, variant) if variant else stage
    return predicted_largest.get(key, default)


def stage_space_for(space: SearchSpace, stage: int, predicted_largest: PredictedLargest,
                    prune: Callable[..., None], offload_fallback: OffloadFallback,
                    report: Callable[[str], None], variant: Knobs = ()) -> tuple[SearchSpace, int] | None:
    """The space a stage (with a variant) is searched in and its largest micro-batch: as configured,
    or with CPU offload when it fits nothing on the device and the fallback offers it; None (pruned) else."""
    space = replace(space, stage_knobs=variant) if variant else space
    predicted = min(largest_for(predicted_largest, stage, variant, space.max_micro_batch_size),
                    space.max_micro_batch_size)
    if predicted >= space.min_micro_batch_size:
        return space, predicted
    fallback = offload_fallback(stage, variant)
    if fallback is None or min(fallback[1], space.max_micro_batch_size) < space.min_micro_batch_size:
        prune_variant(prune, stage, variant, Reason.MEMORY_MODEL, f"memory model: not even micro-batch {space.min_micro_batch_size} fits")
        return None
    knobs, largest_offloaded = fallback
    predicted = min(largest_offloaded, space.max_micro_batch_size)
    report(f"ZeRO {stage}: fits no micro-batch on the device; searched with "
           + ", ".join(f"{k}.device={v}" for k, v in sorted(knobs.items()))
           + (f" and {variant_text(variant)}" if variant else "") + f" (largest micro-batch {predicted})")
    return replace(space, stage_knobs=tuple(sorted({**dict(variant), **knobs}.items()))), predicted


def beyond_previous_variant(stage_space: SearchSpace, stage: int, variant: Knobs, predicted: int,
                            reached: int, prune: Callable[..., None]) -> SearchSpace | None:
    """A variant after the stage's first (activation checkpointing, say) only saves memory at the
    price of time, so it is searched only at micro-batch sizes the less-saving variants could not
    reach: the space above `reached`, or None (pruned) when it fits no more than they did."""
    if not variant or reached <= 0:
        return stage_space
    if predicted <= reached:
        prune_variant(prune, stage, variant, Reason.CANNOT_HELP, f"cannot help: its largest micro-batch ({predicted}) is no larger than "
                                             f"the stage reaches with the variants before it ({reached}), and it "
                                             "only adds time")
        return None
    return replace(stage_space, min_micro_batch_size=max(stage_space.min_micro_batch_size, reached + 1))


def run_search(space: SearchSpace, policy: SearchPolicy, predicted_largest: PredictedLargest, evaluate: Evaluate,
               prune: Callable[..., None], fits: Fits = _always_fits,
               offload_fallback: OffloadFallback = _no_fallback,
               report: Callable[[str], None] = lambda line: None) -> list[TrialResult]:
    """The whole search. `predicted_largest[stage]` is the memory model's largest micro-batch
    (0: the model states alone do not fit); `prune(stage, reason)` records a stage not searched
    (`prune(stage, reason, variant)` a variant of one); nothing is launched that `fits` refuses
    (it may learn from each launch's measured peak). A stage that fits nothing is searched with
    `offload_fallback`'s knobs when it offers some. Each stage's variants are searched in turn,
    each above the sizes the ones before it reached."""
    evaluator = evaluator_of(evaluate)
    evaluate_once = evaluator.for_search(FailedVariants(space, evaluator.results))

    largest_so_far = 0
    for stage in sorted(space.stages):
        reached = 0  # the largest micro-batch this stage reached under its variants so far
        for variant in space.variants_for(stage):
            settled = stage_space_for(space, stage, predicted_largest, prune, offload_fallback, report, variant)
            if settled is None:
                continue
            stage_space, predicted = settled
            searched = beyond_previous_variant(stage_space, stage, variant, predicted, reached, prune)
            if searched is None:
                continue
            later = variant_of(space, stage_space.experiment(stage, 1))
            if later and (reason := not_memory_bound(policy.objective, stage, evaluate_once.answered())):
                prune_variant(prune, stage, variant, Reason.NOT_MEMORY_BOUND, reason)
                continue
            if later and not variant_measured(evaluate_once.answered(), space, variant):
                predicted = first_of_variant(searched, stage, predicted, evaluate_once, fits)
                if predicted is None:
                    prune_variant(prune, stage, variant, Reason.VARIANT_FAILED,
                                  "its first launch, at its smallest size, did not run")
                    continue
            largest = search_rung(searched, policy, stage, variant, predicted, largest_so_far, evaluate_once,
                                  prune, fits)
            # Where the variant ran nothing, what the model gave it stands for what it reaches.
            reached = max(reached, largest if largest is not None else predicted)
            if largest is not None:
                largest_so_far = max(largest_so_far, largest)
    if not policy.fast:
        search_knobs(space, policy, evaluate_once.answered(), evaluate_once, fits=fits)
    search_finishes(space, policy, evaluate_once.answered(), evaluate_once, fits=fits, report=report)
    return evaluate_once.answered()


def first_of_variant(space: SearchSpace, stage: int, predicted: int, evaluate: Evaluate, fits: Fits) -> int | None:
    """A variant never launched is costed from the profile's figures alone, which a process's
    peak can exceed (on a CPU, the recompute's allocations raise the resident peak well above
    what the saved tensors alone hold). So it is launched first at its smallest size; the refitted
    model then gives its largest (None when that launch did not run)."""
    sizes = fitting_micro_batch_sizes(space, stage, predicted, fits)
    if not sizes:
        return predicted
    if evaluate(space.experiment(stage, min(sizes))).state is not TrialState.OK:
        return None
    refitted = fitting_micro_batch_sizes(space, stage, space.max_micro_batch_size, fits)
    return max(refitted, default=min(sizes))


def search_rung(space: SearchSpace, policy: SearchPolicy, stage: int, variant: Knobs, predicted: int,
                largest_so_far: int, evaluate: Evaluator, prune: Callable[..., None], fits: Fits) -> int | None:
    """One stage under one variant: probed once when it fits no larger micro-batch than the
    rungs before it, searched otherwise. Returns the largest micro-batch that ran."""
    must_beat = largest_so_far  # a rung's smaller sizes are only worth trying if it fits more
    if not space.fixed_micro_batch_sizes and largest_so_far and predicted <= largest_so_far:
        reason = probe_stage(space, policy, stage, evaluate.answered(), evaluate, fits)
        if reason is not None:
            before = "an earlier stage or variant's" if variant else "a lower stage's"
            prune_variant(prune, stage, variant, Reason.CANNOT_HELP, f"cannot help: its largest micro-batch ({predicted}) is no larger "
                                                  f"than {before} ({largest_so_far}){reason}")
            return None
        must_beat = 0  # faster at the same size: its other sizes may be too
    largest, stage_results = search_stage(space, policy, stage, predicted, evaluate, must_beat, fits)
    if not stage_results:
        prune_variant(prune, stage, variant, Reason.MEMORY_MODEL,
                      "memory model, with the overhead measured so far: no micro-batch fits")
    return largest


def probe_stage(space: SearchSpace, policy: SearchPolicy, stage: int, so_far: list[TrialResult],
                evaluate: Evaluate, fits: Fits = _always_fits) -> str | None:
    """A stage that fits no larger micro-batch can still be faster at the same one (ZeRO-1's
    sharded optimizer step on a wide model, say). Run the best experiment so far at this stage
    once: None if it wins (search the stage), else the reason to skip the stage."""
    best = policy.objective.best(so_far)
    if best is None:
        return ""
    probe_experiment = space.experiment(stage, best.experiment.micro_batch_size)
    if probe_experiment.micro_batch_size < space.min_micro_batch_size:
        return f"; {best.name}'s micro-batch fits without it"
    if not fits(probe_experiment):
        return f"; the memory model says {probe_experiment.name}, its probe at {best.name}'s micro-batch, does not fit"
    probe = evaluate(probe_experiment)
    if probe.state is TrialState.OK and policy.objective.better(probe.value, best.value):
        return None
    measured = f"{probe.value:.4g}" if probe.value is not None else probe.state.value
    return f"; at {best.name}'s micro-batch it measured {measured} against {best.value:.4g}"
