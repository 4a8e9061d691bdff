"""The memory model fitted to measured peaks: per engine, a line in micro-batch on top of the analytic model.

The analytic model (estimate.py) costs what the launches cannot separate: stage, precision,
offload and gas terms. What it gets wrong grows with the micro-batch: autograd's saved bytes
are not the peak's per-sample growth (convolution work buffers, allocator slack), and a short
profile does not see the steady state. So per engine family (DDP, FSDP2) the residual

    measured peak - analytic estimate = fixed + per_sample x micro-batch

is fitted by least squares to every launch's measured peak, refitted after each launch. An OOM
is a lower bound: the line is raised until it predicts at least the budget there. Pure
functions; the orchestrator keeps the observations.

Beyond the largest measured micro-batch a negative per-sample correction is not carried on: small
sizes carry fixed costs (workspaces, allocator rounding, a floor of about 1 GB at micro-batch 1
on an H200) that a line through them reads as a flatter slope, and that slope, carried 16x
further, predicted an FSDP2 peak 6.6% short (issue 49). Past the last measured size the
correction stays at its value there and the analytic per-sample bytes grow alone; a positive
correction (the model missing bytes per sample) is kept, since it errs on the safe side.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PeakObservation:
    """One launch's peak against what the analytic model alone says for it, in bytes per rank.
    `lower_bound`: the launch ran out of memory, so its peak was at least `measured_bytes`."""

    family: str  # "DDP" or "FSDP2"
    micro_batch_size: int
    modelled_bytes: int
    measured_bytes: int
    lower_bound: bool = False


@dataclass(frozen=True)
class ResidualFit:
    """What the analytic model misses for one engine family: fixed + per_sample x micro-batch bytes."""

    family: str
    fixed_bytes: float
    per_sample_bytes: float
    measured_points: int  # launches that ran (lower bounds excluded)
    slope_source: str  # "fitted", "borrowed from DDP/FSDP2", "none" (one size: a constant), or "raised by OOM"
    # An OOM above a measured size bends the line upward from that size on only: a line tilted
    # through both would predict too little (on an H200, below zero) for every smaller size.
    pivot: int = 0
    slope_above_pivot: float | None = None
    largest_measured: int = 0  # past it, a negative per-sample correction is held at its value there

    def bytes_at(self, micro_batch_size: int) -> int:
        size = micro_batch_size
        if self.per_sample_bytes < 0 and self.largest_measured and size > self.largest_measured:
            size = self.largest_measured
        line = self.fixed_bytes + self.per_sample_bytes * size
        if self.slope_above_pivot is not None and micro_batch_size > self.pivot:
            at_pivot = self.fixed_bytes + self.per_sample_bytes * self.pivot
            line = max(line, at_pivot + self.slope_above_pivot * (micro_batch_size - self.pivot))
        return int(round(line))


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) through (micro-batch, residual) points; None with one size."""
    sizes = {m for m, _ in points}
    if len(sizes) < 2:
        return None
    x = np.array([m for m, _ in points], dtype=float)
    y = np.array([r for _, r in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_residuals(observations: list[PeakObservation], min_slope: dict[str, float] | None = None,
                  per_sample_when_alone: bool = False) -> dict[str, ResidualFit]:
    """One ResidualFit per family that has observations.

    A family measured at one size only borrows the other family's per-sample slope (activations
    per sample hardly depend on the engine), else it is a constant; with `per_sample_when_alone`
    (the analytic model knows no per-sample bytes at all) its excess is taken as per-sample
    instead, a line through the origin. `min_slope[family]` keeps the total per-sample cost from
    going negative (the analytic model's own per-sample bytes, negated).
    """
    min_slope = min_slope or {}
    lines: dict[str, tuple[float, float] | None] = {}
    points: dict[str, list[tuple[int, float]]] = {}
    for family in sorted({o.family for o in observations}):
        points[family] = [(o.micro_batch_size, float(o.measured_bytes - o.modelled_bytes))
                          for o in observations if o.family == family and not o.lower_bound]
        lines[family] = _line(points[family])
    fits = {}
    for family in sorted({o.family for o in observations}):
        line, source = lines[family], "fitted"
        slope = None
        if line is not None:
            slope = line[1]
        else:
            donors = [lines[f][1] for f in sorted(lines) if f != family and lines[f] is not None]
            own_points = points[family]
            if donors:
                slope, source = max(donors), "borrowed from " + next(f for f in sorted(lines) if f != family
                                                                     and lines[f] is not None)
            elif per_sample_when_alone and own_points and own_points[0][1] > 0:
                size, residual = own_points[0]
                slope, source = residual / size, "through the origin"
            else:
                slope, source = 0.0, "none"
        slope = max(slope, min_slope.get(family, -np.inf))
        own = points[family]
        if own:
            # The intercept that makes the line pass through the points' centre with this slope.
            fixed = float(np.mean([r - slope * m for m, r in own]))
        else:
            fixed = 0.0
        fit = ResidualFit(family, fixed, float(slope), len(own), source if own else "none",
                          largest_measured=max((m for m, _ in own), default=0))
        fits[family] = _raise_to_lower_bounds(fit, [o for o in observations if o.family == family], own)
    return fits


def _raise_to_lower_bounds(fit: ResidualFit, observations: list[PeakObservation],
                           measured: list[tuple[int, float]]) -> ResidualFit:
    """Make the fit predict at least each OOM's bound. Pivot on the largest measured micro-batch
    below the OOM (the line stays right where it was measured), on the origin when nothing was
    measured, else raise it as a whole."""
    for bound in sorted((o for o in observations if o.lower_bound), key=lambda o: o.micro_batch_size):
        needed = bound.measured_bytes - bound.modelled_bytes
        if fit.bytes_at(bound.micro_batch_size) >= needed:
            continue
        below = [m for m, _ in measured if m < bound.micro_batch_size]
        if not measured and bound.micro_batch_size > 0:
            # Nothing of this engine measured yet: pivot on the origin, so the excess grows with the
            # micro-batch. A constant would call every smaller size out of memory too, and leave
            # nothing to launch (seen on CUDA with model_info and no activations known).
            fit = ResidualFit(fit.family, 0.0, max(fit.per_sample_bytes, needed / bound.micro_batch_size),
                              fit.measured_points, "raised by OOM", largest_measured=fit.largest_measured)
        elif below:
            pivot = max(below)
            at_pivot = fit.bytes_at(pivot)
            slope = (needed - at_pivot) / (bound.micro_batch_size - pivot)
            base = ResidualFit(fit.family, fit.fixed_bytes, fit.per_sample_bytes, fit.measured_points, "raised by OOM",
                               largest_measured=fit.largest_measured)
            fit = dataclasses.replace(base, fixed_bytes=at_pivot - fit.per_sample_bytes * pivot, pivot=pivot,
                                      slope_above_pivot=slope)
        else:
            fit = ResidualFit(fit.family, needed - fit.per_sample_bytes * bound.micro_batch_size,
                              fit.per_sample_bytes, fit.measured_points, "raised by OOM",
                              largest_measured=fit.largest_measured)
    return fit


def model_error(predicted: list[int], measured: list[int]) -> float | None:
    """The largest relative error |predicted - measured| / measured over launches, or None."""
    pairs = [(p, m) for p, m in zip(predicted, measured) if p and m]
    if not pairs:
        return None
    return max(abs(p - m) / m for p, m in pairs)
