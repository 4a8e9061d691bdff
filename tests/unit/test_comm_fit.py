"""The link model fitted to collective timings: seconds = latency + bytes / bandwidth, per op."""

from __future__ import annotations

import pytest

from autotuner.core.boundary import RecordError
from autotuner.core.probe_records import CollectiveTiming
from autotuner.tuning.models.comm_fit import LinkFit, fit_collectives

SIZES = (2**16, 2**20, 2**22, 2**24)


def timings(op: str, latency_s: float, bytes_per_s: float, sizes=SIZES, noise=()) -> list[CollectiveTiming]:
    factors = list(noise) + [1.0] * (len(sizes) - len(noise))
    return [CollectiveTiming(op, size, (latency_s + size / bytes_per_s) * factor) for size, factor in zip(sizes, factors)]


def test_recovers_a_known_latency_and_bandwidth_per_op():
    fits = fit_collectives(timings("all_reduce", 200e-6, 1e9) + timings("all_gather", 50e-6, 4e9))
    assert set(fits) == {"all_reduce", "all_gather"}
    assert fits["all_reduce"].latency_s == pytest.approx(200e-6, rel=1e-6)
    assert fits["all_reduce"].bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert fits["all_gather"].latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fits["all_gather"].bytes_per_s == pytest.approx(4e9, rel=1e-6)


def test_noisy_timings_still_give_the_bandwidth_within_a_few_percent():
    fit = fit_collectives(timings("reduce_scatter", 1e-4, 2e9, noise=(1.5, 0.8, 1.03, 0.98)))["reduce_scatter"]
    assert fit.bytes_per_s == pytest.approx(2e9, rel=0.05)
    assert fit.latency_s >= 0


def test_seconds_is_latency_plus_bytes_over_bandwidth():
    link = LinkFit("all_reduce", latency_s=1e-3, bytes_per_s=1e9)
    assert link.seconds(0) == pytest.approx(1e-3)
    assert link.seconds(2e9) == pytest.approx(2.001)


def test_one_size_gives_zero_latency_and_that_sizes_bandwidth():
    fit = fit_collectives([CollectiveTiming("all_gather", 2**20, 0.002)])["all_gather"]
    assert fit.latency_s == 0.0
    assert fit.bytes_per_s == pytest.approx(2**20 / 0.002)


def test_repeats_of_one_size_give_the_bandwidth_of_their_mean_time():
    fit = fit_collectives([CollectiveTiming("all_gather", 2**20, 0.001),
                           CollectiveTiming("all_gather", 2**20, 0.003)])["all_gather"]
    assert fit.latency_s == 0.0
    assert fit.bytes_per_s == pytest.approx(2**20 / 0.002)


def test_a_negative_intercept_is_refitted_through_the_origin():
    # Small sizes unusually fast: the free line would cross zero below 0 bytes.
    points = [CollectiveTiming("all_reduce", 2**20, 1e-5), CollectiveTiming("all_reduce", 2**24, 0.02)]
    fit = fit_collectives(points)["all_reduce"]
    assert fit.latency_s == 0.0
    slope = sum(t.bytes * t.seconds for t in points) / sum(t.bytes**2 for t in points)
    assert fit.bytes_per_s == pytest.approx(1 / slope)


def test_an_op_whose_times_do_not_grow_with_size_is_left_out():
    flat = [CollectiveTiming("all_reduce", size, 0.004 - i * 1e-4) for i, size in enumerate(SIZES)]
    fits = fit_collectives(flat + timings("all_gather", 1e-4, 1e9))
    assert "all_reduce" not in fits
    assert set(fits) == {"all_gather"}


def test_no_timings_no_fits():
    assert fit_collectives([]) == {}
    assert fit_collectives(()) == {}


@pytest.mark.parametrize("seconds", [0.0, -0.001, float("nan"), float("inf")])
def test_a_timing_of_nonsense_seconds_is_refused_with_its_op(seconds):
    with pytest.raises(RecordError, match="collective timing of all_reduce: seconds must be finite and > 0"):
        CollectiveTiming("all_reduce", 2**20, seconds)


@pytest.mark.parametrize("nbytes", [0, -4])
def test_a_timing_of_no_bytes_is_refused(nbytes):
    with pytest.raises(RecordError, match="bytes must be > 0"):
        CollectiveTiming("all_gather", nbytes, 0.001)


def test_a_timing_of_an_unknown_op_is_refused():
    with pytest.raises(RecordError, match="unknown op 'broadcast'"):
        CollectiveTiming("broadcast", 2**20, 0.001)


@pytest.mark.parametrize("latency, bandwidth, message", [(-1e-3, 1e9, "latency_s must be"),
                                                          (0.0, 0.0, "bytes_per_s must be"),
                                                          (0.0, float("inf"), "bytes_per_s must be")])
def test_a_link_fit_refuses_negative_latency_and_non_positive_bandwidth(latency, bandwidth, message):
    with pytest.raises(ValueError, match=message):
        LinkFit("all_reduce", latency, bandwidth)
