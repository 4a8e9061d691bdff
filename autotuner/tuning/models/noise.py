"""The run's measurement noise, estimated from the run itself: the relative spread of the
configurations measured more than once. The final pick (searches/final_pick.py) and the
transfer prior (models/transfer.py) both read it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from autotuner.tuning.space.experiment import Experiment

TIE_FLOOR = 0.03  # relative: closer than this is noise on these machines, whatever a window's spread says


@dataclass(frozen=True)
class NoiseLevel:
    """The run's relative measurement noise (one standard deviation, as a fraction of the value)."""

    relative: float
    repeated: int = 0  # configurations measured more than once, that it was estimated from

    @classmethod
    def of(cls, values: dict[Experiment, list[float]]) -> "NoiseLevel":
        spreads = [statistics.stdev(v) / statistics.fmean(v) for v in values.values()
                   if len(v) >= 2 and statistics.fmean(v) > 0]
        if not spreads:
            return cls(TIE_FLOOR)
        return cls(max(TIE_FLOOR / 3, statistics.median(spreads)), len(spreads))

    def describe(self) -> str:
        if not self.repeated:
            return f"Noise level: ±{self.relative:.1%} (assumed: no configuration was measured twice)"
        return (f"Noise level: ±{self.relative:.1%} (relative spread of {self.repeated} configuration(s) measured "
                f"more than once, interleaved)")
