"""What rank 0 decides at the end of each sample window. Pure: times in, decisions and log rows out.

The run goes through four phases:
- warmup: `warmup_samples` windows at the starting knobs, logged and not scored;
- sample: `max_samples` windows at points the optimiser asks for (the starting knobs first);
- remeasure: the best few points by median (and the starting knobs), `remeasure_windows` windows
  each, interleaved and rotated each round, so slow drift in the machine hits them alike (the
  final-pick rule the offline tuner uses too: autotuner/core/interleaved_pick.py);
- final: the point with the best median of its re-measurements is applied for the rest of training.

A window lasts `steps_per_sample` optimizer steps, extended until it has lasted
`sampling_confidence_time` seconds. Its score is samples/s over the window.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from autotuner.core.interleaved_pick import by_median, round_order


class Phase(str, Enum):
    WARMUP = "warmup"
    SAMPLE = "sample"
    REMEASURE = "remeasure"
    FINAL = "final"


Point = tuple[tuple[str, Any], ...]  # sorted (knob, value) pairs: hashable


def point_of(knobs: dict[str, Any]) -> Point:
    return tuple(sorted(knobs.items()))


class Optimizer(Protocol):
    def ask(self) -> dict[str, Any]: ...

    def tell(self, point: dict[str, Any], score: float) -> None: ...


@dataclass(frozen=True)
class ScheduleSettings:
    warmup_samples: int
    steps_per_sample: int
    max_samples: int
    sampling_confidence_time: float
    remeasure_top: int
    remeasure_windows: int


@dataclass(frozen=True)
class Decision:
    """What every rank does next. `extend`: the open window goes on `steps` more steps at the
    same knobs. Otherwise the knobs become `knobs` and, unless `phase` is None (tuning over),
    a window of `steps` steps is measured in that phase."""

    knobs: Point
    phase: Phase | None
    steps: int
    extend: bool = False


@dataclass(frozen=True)
class LogRow:
    knobs: Point
    score: float  # samples/s
    train_iter: int
    phase: Phase


@dataclass(frozen=True)
class Ranked:
    knobs: Point
    median: float
    low: float
    high: float
    windows: int


@dataclass(frozen=True)
class Pick:
    """The final choice, with every re-measured candidate for comparison."""

    knobs: Point
    score: float
    train_iter: int
    start: Point
    ranking: tuple[Ranked, ...]


@dataclass
class OnlineSchedule:
    settings: ScheduleSettings
    start: Point
    optimizer: Optimizer
    window_samples: int  # samples per optimizer step: the global batch
    _phase: Phase = Phase.WARMUP
    _current: Point = ()
    _done_in_phase: int = 0
    _samples: dict[Point, list[float]] = field(default_factory=dict)
    _remeasured: dict[Point, list[float]] = field(default_factory=dict)
    _queue: list[Point] = field(default_factory=list)
    pick: Pick | None = None

    def first(self) -> Decision:
        """The first window, measured from the end of step 1."""
        if self.settings.warmup_samples > 0:
            self._phase, self._current = Phase.WARMUP, self.start
        else:
            self._phase, self._current = Phase.SAMPLE, self._ask()
        return Decision(self._current, self._phase, self.settings.steps_per_sample)

    def _ask(self) -> Point:
        return point_of(self.optimizer.ask())

    def window_ended(self, train_iter: int, steps: int, seconds: float) -> tuple[Decision, list[LogRow]]:
        """The open window has run `steps` optimizer steps in `seconds` (rank 0's clock)."""
        if seconds < self.settings.sampling_confidence_time:
            per_step = max(seconds, 1e-9) / steps
            more = max(1, math.ceil((self.settings.sampling_confidence_time - seconds) / per_step))
            return Decision(self._current, self._phase, more, extend=True), []
        score = self.window_samples * steps / max(seconds, 1e-9)
        row = LogRow(self._current, score, train_iter, self._phase)
        self._record(score)
        decision = self._next(train_iter)
        rows = [row]
        if decision.phase is None and self.pick is not None:
            rows.append(LogRow(self.pick.knobs, self.pick.score, train_iter, Phase.FINAL))
        return decision, rows

    def _record(self, score: float) -> None:
        self._done_in_phase += 1
        if self._phase is Phase.SAMPLE:
            self._samples.setdefault(self._current, []).append(score)
            self.optimizer.tell(dict(self._current), score)
        elif self._phase is Phase.REMEASURE:
            self._remeasured.setdefault(self._current, []).append(score)

    def _enter(self, phase: Phase) -> None:
        self._phase, self._done_in_phase = phase, 0

    def _next(self, train_iter: int) -> Decision:
        steps = self.settings.steps_per_sample
        if self._phase is Phase.WARMUP and self._done_in_phase >= self.settings.warmup_samples:
            self._enter(Phase.SAMPLE)
        if self._phase is Phase.WARMUP:
            return Decision(self._current, Phase.WARMUP, steps)
        if self._phase is Phase.SAMPLE and self._done_in_phase < self.settings.max_samples:
            self._current = self._ask()
            return Decision(self._current, Phase.SAMPLE, steps)
        if self._phase is Phase.SAMPLE:
            self._enter(Phase.REMEASURE)
            self._queue = self._remeasure_order()
            if not self._queue:  # one point only was ever measured: nothing to compare
                return self._finish(self._samples, train_iter)
        if self._queue:
            self._current = self._queue.pop(0)
            return Decision(self._current, Phase.REMEASURE, steps)
        return self._finish(self._remeasured, train_iter)

    def _remeasure_order(self) -> list[Point]:
        """Round-robin over the candidates, rotated each round so none is always measured first."""
        by_median = sorted(self._samples, key=lambda p: statistics.median(self._samples[p]), reverse=True)
        candidates = by_median[:self.settings.remeasure_top]
        if self.start in self._samples and self.start not in candidates:
            candidates.append(self.start)  # the pick must beat where training started, measured alike
        if len(candidates) < 2:
            return []
        return [point for round_index in range(self.settings.remeasure_windows)
                for point in round_order(candidates, round_index)]

    def _finish(self, scores: dict[Point, list[float]], train_iter: int) -> Decision:
        ranking = tuple(Ranked(p, statistics.median(scores[p]), min(scores[p]), max(scores[p]), len(scores[p]))
                        for p in by_median(scores))  # the tuner's final-pick rule, samples/s: higher is better
        best = ranking[0]
        self.pick = Pick(best.knobs, best.median, train_iter, self.start, ranking)
        self._current = best.knobs
        self._enter(Phase.FINAL)
        return Decision(best.knobs, None, 0)
