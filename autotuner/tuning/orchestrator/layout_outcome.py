"""Each layout's outcome in a tune: the frozen records one layout's profile and search leave for
the next layout and the final pick."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotuner.tuning.models.memory_book import MemoryBook
from autotuner.tuning.profiling.job import ProfiledJob
from autotuner.tuning.searches.predictive_search import PredictiveOutcome
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.trials.evaluator import Evaluator


@dataclass(frozen=True)
class LayoutSearch:
    """One layout's profiled job and memory model (a tune that does not search the layout has one,
    at the config's), and the evaluator its launches go through."""

    profiled: ProfiledJob
    memory: MemoryBook
    evaluator: Evaluator


@dataclass(frozen=True)
class LayoutOutcome:
    """What one layout's profile and search produced: its search (None: its profile failed), the
    memory model's reach (for the next layout's rule), its summary line and what the predictive
    tuner predicted there."""

    layout: Layout
    searched: LayoutSearch | None
    reach: dict | None = field(default=None, hash=False)
    layout_line: str | None = None
    predictions: PredictiveOutcome | None = None


def joined_predictions(outcomes: tuple[LayoutOutcome, ...]) -> PredictiveOutcome | None:
    """Every layout's predictions, in turn (a search without the predictive tuner: none)."""
    found = [o.predictions for o in outcomes if o.predictions is not None]
    if not found:
        return None
    return PredictiveOutcome(tuple(r for p in found for r in p.results), tuple(c for p in found for c in p.at_launch),
                             tuple(c for p in found for c in p.final))
