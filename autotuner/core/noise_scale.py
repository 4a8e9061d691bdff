"""The gradient noise scale B_noise = tr(Sigma) / |G|^2 and the goodput it gives. Pure.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training", appendix A.1: from the
squared norms of gradients averaged over B_small and B_big samples,

    |G|^2    ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1/B_small - 1/B_big)

each unbiased; B_noise is the ratio of their means over the steps (the ratio of noisy per-step
estimates is biased, as the paper warns), each step weighted by its precision (`_terms`). Its
spread is the jackknife's over steps.

Past B_noise, steps to a loss fall only as S_min (1 + B_noise/B) and the samples needed grow as
E_min (1 + B/B_noise); the statistical efficiency of a global batch B against the batch B0 the
learning rate was chosen for is (B_noise + B0) / (B_noise + B) (Pollux, OSDI'21, from the same
model), and goodput is throughput times it.

Read once over a tune's profile (`estimate`), or through a whole training run (`SmoothedNoiseScale`:
the same precision-weighted terms, each an exponential moving average over the steps, as
McCandlish's appendix A.1 and Pollux smooth them, so B_noise follows as it grows). Here in the
core, the tuner and the ranks read one estimator.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

from autotuner.core.boundary import Measurement

MIN_STEPS = 3  # per-step pairs needed for an estimate (and a spread)


@dataclass(frozen=True)
class NoiseScale:
    b_noise: float
    spread: float  # the jackknife's standard error
    steps: int
    gradient_sq: float  # |G|^2 estimate
    trace_sigma: float  # tr(Sigma) estimate


def _pairs(measurements: Iterable[Measurement]) -> list[tuple[float, float, int, int]]:
    """(|g_small|^2, |g_big|^2, B_small, B_big) per step, over every launch that read them."""
    out = []
    for m in measurements:
        if len(m.gradient_noise_batches) == 2 and m.gradient_noise_batches[1] > m.gradient_noise_batches[0]:
            small, big = m.gradient_noise_batches
            out += [(g_small, g_big, small, big) for g_small, g_big in m.gradient_norms]
    return out


def _terms(pairs: list[tuple[float, float, int, int]]) -> tuple[float, float]:
    """|G|^2 and tr(Sigma) over the steps, each step weighted by its precision. A squared norm
    over B samples scatters by about tr(Sigma)/B, so a step's |G|^2 estimate scatters as
    1/(B_big - B_small) and its tr(Sigma) estimate as B_big/(B_big - B_small): the profile's
    micro-batch-1 steps, whose |G|^2 is mostly noise, count (B_big - B_small)^2 less than a step
    over thousands of samples (unweighted, they put B_noise 8x below a direct measurement)."""
    gradient = [(big * g_big - small * g_small) / (big - small) for g_small, g_big, small, big in pairs]
    trace = [(g_small - g_big) / (1 / small - 1 / big) for g_small, g_big, small, big in pairs]
    gradient_weights = [(big - small) ** 2 for _, _, small, big in pairs]
    trace_weights = [((big - small) / big) ** 2 for _, _, small, big in pairs]
    return _weighted(gradient, gradient_weights), _weighted(trace, trace_weights)


def _weighted(values: list[float], weights: list[float]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def estimate(measurements: Iterable[Measurement]) -> NoiseScale | None:
    """B_noise from every launch's per-step pairs; None with fewer than MIN_STEPS, or where the
    true gradient's estimate is not positive (the noise swamps it: more steps are needed)."""
    pairs = _pairs(measurements)
    if len(pairs) < MIN_STEPS:
        return None
    gradient, trace = _terms(pairs)
    if gradient <= 0 or trace <= 0:
        return None
    b_noise = trace / gradient
    leave_one_out = []
    for index in range(len(pairs)):
        g, t = _terms(pairs[:index] + pairs[index + 1:])
        if g > 0:
            leave_one_out.append(t / g)
    n = len(leave_one_out)
    spread = math.sqrt((n - 1) / n * sum((x - statistics.fmean(leave_one_out)) ** 2 for x in leave_one_out)) \
        if n > 1 else float("inf")
    return NoiseScale(b_noise, spread, len(pairs), gradient, trace)


@dataclass(frozen=True)
class SmoothedNoiseScale:
    """B_noise through training: |G|^2 and tr(Sigma) each a precision-weighted exponential moving
    average of the steps' unbiased estimates (weights as `_terms`), forgetting with time constant
    `window` steps; their ratio is B_noise. A record: `with_step` returns the next one."""

    window: int
    gradient_sum: float = 0.0  # sum of weight x estimate, decayed
    gradient_weight: float = 0.0
    trace_sum: float = 0.0
    trace_weight: float = 0.0
    steps: int = 0

    def with_step(self, g_small: float, g_big: float, small: int, big: int) -> "SmoothedNoiseScale":
        """The estimator after one more step's pair (B_small < B_big samples behind them)."""
        if big <= small:
            return self
        decay = 1.0 - 1.0 / max(1, self.window)
        gradient_w, trace_w = (big - small) ** 2, ((big - small) / big) ** 2
        gradient = (big * g_big - small * g_small) / (big - small)
        trace = (g_small - g_big) / (1 / small - 1 / big)
        return SmoothedNoiseScale(self.window, decay * self.gradient_sum + gradient_w * gradient,
                                  decay * self.gradient_weight + gradient_w, decay * self.trace_sum + trace_w * trace,
                                  decay * self.trace_weight + trace_w, self.steps + 1)

    @property
    def b_noise(self) -> float | None:
        """tr(Sigma) / |G|^2 from the averages; None before MIN_STEPS steps or while the true
        gradient's average is not positive (the noise swamps it)."""
        if self.steps < MIN_STEPS or self.gradient_weight <= 0 or self.trace_weight <= 0:
            return None
        gradient, trace = self.gradient_sum / self.gradient_weight, self.trace_sum / self.trace_weight
        return trace / gradient if gradient > 0 and trace > 0 else None

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (`from_state` reads it back)."""
        return {"window": self.window, "gradient_sum": self.gradient_sum, "gradient_weight": self.gradient_weight,
                "trace_sum": self.trace_sum, "trace_weight": self.trace_weight, "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict[str, float]) -> "SmoothedNoiseScale":
        return cls(int(state["window"]), float(state["gradient_sum"]), float(state["gradient_weight"]),
                   float(state["trace_sum"]), float(state["trace_weight"]), int(state["steps"]))


def statistical_efficiency(global_batch: int, reference_batch: int, b_noise: float) -> float:
    """Progress per sample at `global_batch` against `reference_batch`: (B_noise + B0) / (B_noise + B)."""
    return (b_noise + reference_batch) / (b_noise + global_batch)


def scaled_learning_rate(lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """The learning rate for `global_batch`, chosen for `reference_batch`: "linear" (Goyal et al.),
    "sqrt" (Krizhevsky; Hoffer et al., for Adam-like optimizers) or "none"."""
    ratio = global_batch / reference_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    return lr
