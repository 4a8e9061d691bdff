"""Link models fitted to a profile's collective timings: seconds = latency + bytes / bandwidth.

Pure functions on `CollectiveTiming` records (boundary.py); the tuner costs a ZeRO stage's
communication with `LinkFit.seconds` of the ops that stage runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from autotuner.core.probe_records import COLLECTIVE_OPS, CollectiveTiming


@dataclass(frozen=True)
class LinkFit:
    """One collective's cost on the job's process group. `bytes` means what CollectiveTiming
    means: the full, unsharded tensor."""

    op: str
    latency_s: float  # >= 0
    bytes_per_s: float  # > 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"{self.op}: latency_s must be finite and >= 0, not {self.latency_s}")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"{self.op}: bytes_per_s must be finite and > 0, not {self.bytes_per_s}")

    def seconds(self, nbytes: float) -> float:
        """Predicted seconds for one call moving a full tensor of `nbytes` bytes."""
        return self.latency_s + nbytes / self.bytes_per_s


def fit_collectives(timings: Iterable[CollectiveTiming], group_size: int = 0) -> dict[str, LinkFit]:
    """A least-squares `LinkFit` per op found in `timings` timed on groups of `group_size` (0: the
    job's whole group), in COLLECTIVE_OPS order.

    With two or more sizes: the ordinary least-squares line, refitted through the origin
    (latency 0) when its intercept comes out negative. With one size: latency 0 and the
    bandwidth of that size. An op whose times do not grow with size (the line's slope is not
    positive, so no bandwidth can be read from them) is left out; so is an op with no timings.
    The records themselves refuse zero, negative or non-finite seconds and bytes."""
    by_op: dict[str, list[CollectiveTiming]] = {}
    for timing in timings:
        if timing.group_size == group_size:
            by_op.setdefault(timing.op, []).append(timing)
    fits = {}
    for op in COLLECTIVE_OPS:
        points = [(float(t.bytes), t.seconds) for t in by_op.get(op, ())]
        fit = _fit_line(op, points) if points else None
        if fit is not None:
            fits[op] = fit
    return fits


def _fit_line(op: str, points: list[tuple[float, float]]) -> LinkFit | None:
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    if var_x > 0:
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x
        latency = mean_y - slope * mean_x
        if latency >= 0:
            return LinkFit(op, latency, 1.0 / slope) if slope > 0 else None
    # One size, or a negative intercept: the least-squares line through the origin. Every point
    # has positive bytes and seconds, so its slope is positive.
    slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return LinkFit(op, 0.0, 1.0 / slope)
