"""When a layout's search (a tensor-parallel degree, pipeline stages) cannot help, from its profile: the same rule the stage
search applies to a ZeRO stage ("cannot help: its largest micro-batch is no larger than a lower
stage's"), across degrees. Splitting the model buys memory (a larger micro-batch) at the cost of
the collectives it adds; a degree that reaches no larger micro-batch at any stage than a degree
searched before, and measured slower at every size both profiled, has nothing to buy with it."""

from __future__ import annotations

from typing import Mapping, Sequence

from autotuner.tuning.models.cost_model import NOISE_FLOOR
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState

# (the memory model's largest micro-batch per stage or (stage, variant), this layout's results)
Reach = tuple[Mapping[object, int], Sequence[TrialResult]]


def _best_by_size(results: Sequence[TrialResult]) -> dict[tuple[int, int], TrialResult]:
    """The best measured result at each (ZeRO stage, micro-batch), whatever its gas."""
    best: dict[tuple[int, int], TrialResult] = {}
    for result in results:
        if result.state is not TrialState.OK or result.value is None:
            continue
        key = (result.experiment.zero_stage, result.experiment.micro_batch_size)
        if key not in best or result.value > best[key].value:
            best[key] = result
    return best


def degree_cannot_help(layout: Layout, reach: Reach, searched: Mapping[Layout, Reach], unit: str) -> str | None:
    """Why searching `layout` further would be wasted, or None: some layout searched before reaches
    at least its largest micro-batch at each of its stages, and measured faster (beyond the noise
    floor) at every stage and micro-batch both profiled, at least one."""
    largest, results = reach
    ours = _best_by_size(results)
    for other, (their_largest, their_results) in searched.items():
        if any(their_largest.get(key, 0) < size for key, size in largest.items()):
            continue  # this layout fits a larger micro-batch somewhere: memory it may turn into speed
        theirs = _best_by_size(their_results)
        shared = sorted(set(ours) & set(theirs))
        if shared and all(theirs[key].value > ours[key].value * (1 + NOISE_FLOOR) for key in shared):
            stage, size = shared[-1]
            return (f"cannot help: {other.text()} reaches as large a micro-batch at every stage and measured "
                    f"faster at each size both profiled (z{stage} micro-batch {size}: {theirs[(stage, size)].value:.4g} "
                    f"against {ours[(stage, size)].value:.4g} {unit})")
    return None
