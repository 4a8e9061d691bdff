"""The noise-aware final pick: contenders within the measured spread of the best are re-measured
interleaved, and the best median wins. Pure: the orchestrator launches the re-measurements.

One measured launch moves by a few percent run to run on a busy host (and more on a shared CPU),
so the single best measurement is often a lucky one. Candidates whose value is within the
spread of the best (their own step-to-step spread, and never less than TIE_FLOOR) are
re-measured in rounds (A B C, then B C A, ...), and each is scored by the median of all its
measurements. Medians still within each other's spread are marked as ties.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from autotuner.tuning.records import Objective, TrialResult, TrialState
from autotuner.tuning.space import Experiment

TIE_FLOOR = 0.03  # relative: closer than this is noise on these machines, whatever a window's spread says


def relative_spread(result: TrialResult) -> float:
    own = (result.value_std / result.value) if result.value_std and result.value else 0.0
    return max(TIE_FLOOR, own)


def contenders(results: list[TrialResult], objective: Objective, top: int) -> list[TrialResult]:
    """The best result and up to `top - 1` others within the measured spread of it, best first."""
    ok = [r for r in results if r.state is TrialState.OK and r.value is not None]
    ranked = sorted(ok, key=lambda r: r.value, reverse=objective.maximize)
    unique: list[TrialResult] = []
    for result in ranked:
        if result.experiment not in {u.experiment for u in unique}:
            unique.append(result)
    if not unique:
        return []
    best = unique[0]
    band = relative_spread(best)
    close = [r for r in unique[1:] if abs(r.value - best.value) <= (band + relative_spread(r)) * abs(best.value)]
    return [best, *close[: max(0, top - 1)]]


def interleaved_order(experiments: list[Experiment], rounds: int) -> list[tuple[int, Experiment]]:
    """(round, experiment) launches: each round rotated by one, so no candidate always goes first."""
    order = []
    for round_index in range(rounds):
        shift = round_index % max(1, len(experiments))
        order += [(round_index, e) for e in experiments[shift:] + experiments[:shift]]
    return order


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


def pick(contenders_with_runs: list[Contender], objective: Objective) -> FinalPick:
    """The best median; a contender that failed a re-measurement cannot win over one that did not."""
    ranked = sorted(contenders_with_runs, key=lambda c: (c.failed_runs, -c.median if objective.maximize
                                                          else c.median))
    chosen = ranked[0]
    ties = []
    for other in ranked[1:]:
        overlap = other.high >= chosen.low if objective.maximize else other.low <= chosen.high
        close = abs(other.median - chosen.median) <= TIE_FLOOR * abs(chosen.median)
        if other.failed_runs == 0 and (overlap or close):
            ties.append(other.experiment)
    return FinalPick(chosen, tuple(ranked), tuple(ties))


def describe(final: FinalPick, objective: Objective) -> list[str]:
    """Summary lines: the choice, each contender's median and range, and the ties."""
    if not final.remeasured:
        return []
    lines = [f"Final pick, re-measured interleaved ({objective.unit}, median of runs, range):"]
    for contender in final.contenders:
        runs = ", ".join(f"{v:.4g}" for v in contender.values)
        failed = f", {contender.failed_runs} failed" if contender.failed_runs else ""
        mark = "chosen" if contender is final.chosen else (
            f"within noise of {final.chosen.experiment.name}" if contender.experiment in final.ties else "")
        lines.append(f"  {contender.experiment.name}: {contender.median:.4g} ({contender.low:.4g}-{contender.high:.4g};"
                     f" runs {runs}{failed}){' ' + mark if mark else ''}")
    return lines
