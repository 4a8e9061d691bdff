"""The residual line fitted to measured peaks (autotuner/tuning/memory/peak_fit.py). Pure."""

from __future__ import annotations

import pytest

from autotuner.tuning.memory.peak_fit import PeakObservation, fit_residuals, model_error

MiB = 2**20


def seen(micro, residual_mib, family="DDP", modelled_mib=500, lower_bound=False):
    modelled = modelled_mib * MiB
    return PeakObservation(family, micro, modelled, modelled + int(residual_mib * MiB), lower_bound)


def test_two_sizes_recover_fixed_and_per_sample_bytes():
    fit = fit_residuals([seen(1, 13), seen(32, 13 + 31 * 6)])["DDP"]
    assert fit.fixed_bytes == pytest.approx(7 * MiB)
    assert fit.per_sample_bytes == pytest.approx(6 * MiB)
    assert (fit.measured_points, fit.slope_source) == (2, "fitted")
    assert fit.bytes_at(64) == pytest.approx(7 * MiB + 64 * 6 * MiB, abs=1)


def test_noisy_points_are_fitted_by_least_squares():
    fit = fit_residuals([seen(1, 10), seen(1, 12), seen(9, 50), seen(9, 52)])["DDP"]
    assert fit.per_sample_bytes == pytest.approx(5 * MiB)
    assert fit.fixed_bytes == pytest.approx(6 * MiB)


def test_one_size_is_a_constant_unless_the_other_engine_has_a_slope():
    alone = fit_residuals([seen(8, 40, "FSDP2")])["FSDP2"]
    assert (alone.fixed_bytes, alone.per_sample_bytes, alone.slope_source) == (40 * MiB, 0.0, "none")
    fits = fit_residuals([seen(8, 40, "FSDP2"), seen(1, 0), seen(11, 20)])
    assert fits["FSDP2"].per_sample_bytes == pytest.approx(2 * MiB)
    assert fits["FSDP2"].slope_source == "borrowed from DDP"
    assert fits["FSDP2"].bytes_at(8) == pytest.approx(40 * MiB, abs=1)  # still through its own point


def test_the_slope_floor_keeps_the_total_per_sample_cost_non_negative():
    fit = fit_residuals([seen(1, 0), seen(11, -100)], {"DDP": -4.0 * MiB})["DDP"]
    assert fit.per_sample_bytes == -4.0 * MiB


def test_an_oom_pivots_the_line_on_the_largest_size_that_ran_below_it():
    # Ran at 4 and 16 (residual 10 MiB flat); OOM at 32 with the budget 300 MiB over the analytic model.
    fit = fit_residuals([seen(4, 10), seen(16, 10), seen(32, 300, lower_bound=True)])["DDP"]
    assert fit.bytes_at(16) == pytest.approx(10 * MiB, abs=1)
    assert fit.bytes_at(32) == pytest.approx(300 * MiB, abs=1)
    assert fit.slope_source == "raised by OOM"


def test_an_oom_already_predicted_changes_nothing_and_without_runs_pivots_on_the_origin():
    fits = fit_residuals([seen(4, 10), seen(16, 10), seen(32, 5, lower_bound=True)])
    assert fits["DDP"].slope_source == "fitted"
    only = fit_residuals([seen(32, 300, lower_bound=True)])["DDP"]
    assert only.bytes_at(32) == pytest.approx(300 * MiB, abs=1) and only.measured_points == 0
    # Smaller sizes stay launchable: a constant would have called micro-batch 1 out of memory too
    # (the predictive tuner then launched nothing after a real CUDA OOM).
    assert only.bytes_at(16) == pytest.approx(150 * MiB, abs=1) and only.fixed_bytes == 0


def test_model_error_is_the_largest_relative_miss():
    assert model_error([110, 95], [100, 100]) == pytest.approx(0.10)
    assert model_error([None], [100]) is None


def test_without_known_per_sample_bytes_a_lone_peak_is_taken_as_per_sample():
    fit = fit_residuals([seen(32, 320)], per_sample_when_alone=True)["DDP"]
    assert fit.per_sample_bytes == pytest.approx(10 * MiB) and fit.slope_source == "through the origin"
    assert fit.bytes_at(16) == pytest.approx(160 * MiB, abs=1)


def test_an_oom_just_above_a_measured_size_bends_the_line_there_and_leaves_smaller_sizes_as_measured():
    # An H200 grid search (DeepSpeed ZeRO-0, gpt2-medium): allocated peaks 8,186 / 69,917 / 124,865 MiB
    # at micro-batch 1 / 32 / 59, out of memory at 63 (budget 141,831 MiB). The line tilted through
    # (59, measured) and (63, budget) predicted 1,850 MiB at micro-batch 30 and -61,771 MiB at 15,
    # where 65,852 and 35,325 MiB were then measured.
    fit = fit_residuals([seen(1, 8186, modelled_mib=0), seen(32, 69917, modelled_mib=0),
                         seen(59, 124865, modelled_mib=0), seen(63, 141831, modelled_mib=0, lower_bound=True)])["DDP"]
    assert fit.slope_source == "raised by OOM" and fit.pivot == 59
    for micro, measured_mib in ((15, 35325), (30, 65852)):
        assert fit.bytes_at(micro) / MiB == pytest.approx(measured_mib, rel=0.05)
    assert fit.bytes_at(63) >= 141831 * MiB and fit.bytes_at(61) > fit.bytes_at(59)
