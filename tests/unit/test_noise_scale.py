"""The gradient noise scale through training (issue 70): the smoothed estimator the ranks keep, in
the core beside the profile's, agrees with it without forgetting and follows B_noise as it grows."""

from __future__ import annotations

import random

import pytest

from autotuner.core.boundary import Measurement
from autotuner.core.noise_scale import SmoothedNoiseScale, estimate


def pair(gradient_sq: float, trace: float, small: int, big: int, noise: float = 0.0, rng=None):
    """The expected squared norms of gradients over `small` and `big` samples, with relative noise."""
    jitter = (lambda: 1 + noise * rng.gauss(0, 1)) if rng else (lambda: 1.0)
    return (gradient_sq + trace / small) * jitter(), (gradient_sq + trace / big) * jitter()


def test_without_forgetting_it_is_the_profiles_estimate():
    rng = random.Random(0)
    steps = [(*pair(1.0, 300.0, small, small * 4, 0.05, rng), small, small * 4) for small in (2, 4, 8) * 5]
    smoothed = SmoothedNoiseScale(window=10**9)
    for step in steps:
        smoothed = smoothed.with_step(*step)
    profile = estimate([Measurement(throughput=1.0, latency=1.0,
                                    gradient_norms=tuple((g_small, g_big) for g_small, g_big, b_small, _ in steps
                                                         if b_small == small),
                                    gradient_noise_batches=(small, small * 4)) for small in (2, 4, 8)])
    assert smoothed.b_noise == pytest.approx(profile.b_noise, rel=1e-6)  # (1e-9 forgetting over 15 steps)


def test_it_follows_a_growing_noise_scale_within_its_window():
    # B_noise grows tenfold over 400 steps (|G|^2 falls as training goes on); a 20-step window ends
    # near the last value, no forgetting about midway.
    short, never = SmoothedNoiseScale(window=20), SmoothedNoiseScale(window=10**9)
    for step in range(400):
        b_noise = 100.0 * 10 ** (step / 399)
        figures = (*pair(1.0 / b_noise, 1.0, 16, 64), 16, 64)
        short, never = short.with_step(*figures), never.with_step(*figures)
    assert short.b_noise == pytest.approx(1000.0, rel=0.15)
    assert never.b_noise < 600


def test_too_few_steps_or_swamped_gradient_give_none_and_the_state_round_trips():
    smoothed = SmoothedNoiseScale(window=50)
    assert smoothed.b_noise is None
    for _ in range(2):
        smoothed = smoothed.with_step(*pair(1.0, 10.0, 4, 16), 4, 16)
    assert smoothed.b_noise is None  # fewer than MIN_STEPS
    smoothed = smoothed.with_step(*pair(1.0, 10.0, 4, 16), 4, 16)
    assert smoothed.b_noise == pytest.approx(10.0)
    assert SmoothedNoiseScale.from_state(smoothed.state()) == smoothed
    swamped = SmoothedNoiseScale(window=50)
    for _ in range(5):
        swamped = swamped.with_step(2.0, 3.0, 4, 16)  # the big batch's norm above the small's: no signal
    assert swamped.b_noise is None
    assert swamped.with_step(1.0, 1.0, 16, 16) == swamped  # no second batch size: nothing learned
