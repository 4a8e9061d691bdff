"""The noise-aware final pick: the contenders that could still beat the best are re-measured
interleaved, round after round until the best stands apart, the rest are within the noise of it
(a gain smaller than the noise is not worth another round), or the rounds run out; the best median
wins. Pure: the orchestrator launches the re-measurements.

A re-measurement is a launch, so it follows the search's launch rule (tuners/predictive.py): a
contender is re-measured only if, at the same one-sided bound (BOUND_Z) on the difference of the
two measurements, it could beat the best by more than the worthwhile gain (NOISE_FLOOR). Before,
everything within twice the noise of the best was re-measured (6% at the 3% floor, against 4%
now): in simulation that cost 0.4-0.8 launches a tune and bought no pick quality
(docs/benchmarks/transfer.md, "which contenders a re-measurement is worth").

One measured launch moves by a few percent run to run on a busy host (and more on a shared CPU),
so the single best measurement is often a lucky one. The noise level is estimated from the run
itself: the relative spread of configurations measured more than once (re-measurements), and
before there are any, TIE_FLOOR or the best window's standard error if wider (its step-to-step
spread over the root of its steps: the spread of single steps is not that of a window's mean).
Medians still within twice the noise of the chosen one are reported as ties.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Callable

from autotuner.core.interleaved_pick import by_median, round_order
from autotuner.tuning.models.cost_model import BOUND_Z, NOISE_FLOOR
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.models.noise import TIE_FLOOR, NoiseLevel
from autotuner.tuning.space.experiment import Experiment


def relative_spread(result: TrialResult) -> float:
    return max(TIE_FLOOR, result.relative_error)


def contenders(results: list[TrialResult], objective: Objective, top: int, noise: float = TIE_FLOOR,
               medians: dict[Experiment, float] | None = None,
               worthwhile_gain: float = NOISE_FLOOR,
               ruled_out: Callable[[TrialResult, TrialResult], bool] = lambda result, best: False,
               ) -> list[TrialResult]:
    """The best result and up to `top - 1` others that could beat it by more than `worthwhile_gain`,
    best first: each one's value plus BOUND_Z spreads of the difference between the two, where a
    measurement's spread is the noise level (or the window's own, if wider), and not
    `ruled_out(result, best)` (a model that pools every launch may rule one out, never in).
    `medians` replaces the value of what was re-measured."""
    medians = medians or {}
    ok = [r for r in results if r.state is TrialState.OK and r.value is not None]

    def value(result: TrialResult) -> float:
        return medians.get(result.experiment, result.value)

    ranked = objective.rank(ok, value)
    unique: list[TrialResult] = []
    for result in ranked:
        if result.experiment not in {u.experiment for u in unique}:
            unique.append(result)
    if not unique:
        return []
    best = unique[0]

    def spread(result: TrialResult) -> float:
        return max(noise, relative_spread(result) if result.experiment not in medians else 0.0)

    sign = 1 if objective.maximize else -1
    to_beat = value(best) * (1 + sign * worthwhile_gain)

    def could_beat_best(result: TrialResult) -> bool:
        difference_spread = math.hypot(spread(best), spread(result)) * abs(value(best))
        return objective.better(value(result) + sign * BOUND_Z * difference_spread, to_beat)

    best_so_far = replace(best, value=value(best))
    close = [r for r in unique[1:] if could_beat_best(r) and not ruled_out(r, best_so_far)]
    return [best, *close[: max(0, top - 1)]]


@dataclass(frozen=True)
class Contender:
    experiment: Experiment
    values: tuple[float, ...]  # every measurement, the search's first
    failed_runs: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)


@dataclass(frozen=True)
class FinalPick:
    chosen: Contender
    contenders: tuple[Contender, ...]  # best median first
    ties: tuple[Experiment, ...]  # within noise of the chosen one

    @property
    def remeasured(self) -> bool:
        return any(len(c.values) > 1 for c in self.contenders)


def pick(contenders_with_runs: list[Contender], objective: Objective, noise: float = TIE_FLOOR) -> FinalPick:
    """The best median; a contender that failed a re-measurement cannot win over one that did not
    (the shared rule, interleaved_pick.by_median). Ties: ranges that overlap the chosen one's, or
    medians within twice the noise of it."""
    by_experiment = {c.experiment: c for c in contenders_with_runs}
    ranked = [by_experiment[e] for e in by_median({c.experiment: c.values for c in contenders_with_runs},
                                                  objective.maximize,
                                                  {c.experiment: c.failed_runs for c in contenders_with_runs})]
    chosen = ranked[0]
    ties = []
    for other in ranked[1:]:
        overlap = other.high >= chosen.low if objective.maximize else other.low <= chosen.high
        close = abs(other.median - chosen.median) <= 2 * noise * abs(chosen.median)
        if other.failed_runs == 0 and (overlap or close):
            ties.append(other.experiment)
    return FinalPick(chosen, tuple(ranked), tuple(ties))


def stands_apart(values: dict[Experiment, list[float]], objective: Objective, noise: float) -> bool:
    """Whether the best median beats every other contender's by more than twice the noise."""
    medians = objective.order(statistics.median(v) for v in values.values() if v)
    if len(medians) < 2:
        return True
    return abs(medians[0] - medians[1]) > 2 * noise * abs(medians[0])


def settled(values: dict[Experiment, list[float]], objective: Objective, noise: float) -> bool:
    """Whether another round is not worth it: the best median stands apart, or every re-measured
    contender is within the noise of it, and never less than TIE_FLOOR (the most a further round
    could find is a gain under the minimum worthwhile one; the search stops at the same gain)."""
    medians = objective.order(statistics.median(v) for v in values.values() if v)
    if len(medians) < 2 or stands_apart(values, objective, noise):
        return True
    remeasured = all(len(v) >= 2 for v in values.values())
    return remeasured and abs(medians[0] - medians[1]) <= max(noise, TIE_FLOOR) * abs(medians[0])


def describe(final: FinalPick, objective: Objective) -> list[str]:
    """Summary lines: the choice, each contender's median and range, and the ties."""
    if not final.remeasured:
        return []
    lines = [f"Final pick, re-measured interleaved ({objective.unit}, median of runs, range):"]
    for contender in final.contenders:
        runs = ", ".join(f"{v:.4g}" for v in contender.values)
        failed = f", {contender.failed_runs} failed" if contender.failed_runs else ""
        mark = "chosen" if contender is final.chosen else (
            f"tie within noise with {final.chosen.experiment.name}" if contender.experiment in final.ties else "")
        lines.append(f"  {contender.experiment.name}: {contender.median:.4g} ({contender.low:.4g}-{contender.high:.4g};"
                     f" runs {runs}{failed}){' ' + mark if mark else ''}")
    return lines


def final_pick_rounds(results: list[TrialResult], objective: Objective, top: int, rounds: int,
                      remeasure: Callable[[Experiment, int, bool], TrialResult],
                      report: Callable[[str], None],
                      reusable: Callable[[Experiment, int], bool] = lambda experiment, run: False,
                      ruled_out: Callable[[TrialResult, TrialResult], bool] = lambda result, best: False,
                      ) -> tuple[TrialResult | None, list, list[str]]:
    """Re-measure the contenders that could beat the best (`contenders`), interleaved (each round
    rotated by one), round after round until the pick is settled (`settled`) or `rounds` run out;
    the best median wins. `remeasure(experiment, run, reuse)` gives one, an earlier run's record
    where `reuse`; `reusable(experiment, run)` says whether there is one. A round reuses records only
    when every contender has one: a fresh launch beside records of another run, on a machine in
    another state, would not be interleaved with them. `ruled_out(result, best)`: the search's
    step-time model, fitted on every launch, says `result` cannot beat `best` (at its value so
    far) by the worthwhile gain. Returns (the pick, with its median as value; (round, result)
    re-measurements; summary lines)."""
    best = objective.best(results)
    noise = NoiseLevel(relative_spread(best) if best is not None else TIE_FLOOR)
    values: dict[Experiment, list[float]] = {}
    failed: dict[Experiment, int] = {}
    out_of_memory: set[Experiment] = set()  # a run that does not always fit is never the pick
    remeasurements = []
    first = {r.experiment: r.value for r in results if r.state is TrialState.OK and r.value is not None}
    chosen: list[Experiment] = []
    model_lines: list[str] = []
    for round_index in range(rounds):
        medians = {e: statistics.median(v) for e, v in values.items() if v}
        standing = [r for r in results if r.experiment not in out_of_memory]
        chosen = [r.experiment for r in contenders(standing, objective, top, noise.relative, medians,
                                                   ruled_out=ruled_out)]
        if round_index == 0:
            band = contenders(standing, objective, top, noise.relative, medians)
            dropped = [r.experiment.name for r in band if r.experiment not in chosen]
            if dropped:
                model_lines.append(
                    f"Final pick: {', '.join(dropped)} not re-measured: within the measurements' band of "
                    f"{band[0].name}, but the step-time model on every launch puts "
                    f"{'it' if len(dropped) == 1 else 'them'} more than {NOISE_FLOOR:.0%} short of it")
        if len(chosen) < 2 and not values:
            break
        if round_index == 0:
            report(f"final pick: {', '.join(e.name for e in chosen[1:])} could beat {chosen[0].name} by more than "
                   f"{NOISE_FLOOR:.0%} at a noise level of ±{noise.relative:.1%}; re-measuring them interleaved "
                   f"(at most {rounds} round(s))")
        for experiment in chosen:
            values.setdefault(experiment, [first[experiment]])
            failed.setdefault(experiment, 0)
        # In the order they first became contenders, rotated by one each round (the shared rule).
        order = round_order([e for e in values if e in chosen], round_index)
        reuse = all(reusable(experiment, round_index + 1) for experiment in order)
        for experiment in order:
            result = remeasure(experiment, round_index + 1, reuse)
            remeasurements.append((round_index + 1, result))
            if result.state is TrialState.OK and result.value is not None:
                values[experiment].append(result.value)
            else:
                failed[experiment] += 1
                if result.state is TrialState.OOM:
                    out_of_memory.add(experiment)
        noise = NoiseLevel.of(values)
        if settled({e: values[e] for e in chosen if e not in out_of_memory}, objective, noise.relative):
            break
    lines = [noise.describe(), *model_lines]
    lines += [f"{e.name} ran out of memory when re-measured: not picked" for e in sorted(out_of_memory)]
    # The last round's contenders only: one dropped earlier ran fewer times, so fewer of its runs could fail.
    standing = [e for e in values if e in chosen and e not in out_of_memory]
    if not standing:
        fallback = objective.best([r for r in results if r.experiment not in out_of_memory])
        return fallback, remeasurements, lines
    final = pick([Contender(e, tuple(values[e]), failed[e]) for e in standing], objective, noise.relative)
    lines += describe(final, objective)  # the summary's lines: printed once, there
    original = next(r for r in results if r.experiment == final.chosen.experiment and r.state is TrialState.OK)
    return replace(original, value=final.chosen.median), remeasurements, lines
