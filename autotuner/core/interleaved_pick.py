"""The one rule for picking among close contenders, shared by the tuner's final pick
(tuning/searches/final_pick.py) and the online tuner (runtime/online/schedule.py): measure them
interleaved, each round in the same order rotated by one so none is always measured first (slow
drift in the machine then hits them alike), and rank by the median of their measurements, a
contender that failed a measurement behind every one that did not."""

from __future__ import annotations

import statistics
from typing import Hashable, Mapping, Sequence, TypeVar

Candidate = TypeVar("Candidate", bound=Hashable)


def round_order(candidates: Sequence[Candidate], round_index: int) -> list[Candidate]:
    """Round `round_index` (from 0): `candidates` in their order, rotated by one per round."""
    if not candidates:
        return []
    shift = round_index % len(candidates)
    return [*candidates[shift:], *candidates[:shift]]


def by_median(values: Mapping[Candidate, Sequence[float]], maximize: bool = True,
              failed: Mapping[Candidate, int] | None = None) -> list[Candidate]:
    """Candidates with measurements, best first: fewest failed measurements, then best median."""
    failed = failed or {}
    measured = [c for c, v in values.items() if v]
    return sorted(measured, key=lambda c: (failed.get(c, 0), -statistics.median(values[c]) if maximize
                                           else statistics.median(values[c])))
