"""Memory when batches vary in length (issue 49, section 2): a launch is judged at the run's
longest batch, from the record steps of its window. Pure."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autotuner.core.boundary import Measurement
from autotuner.tuning.memory.varying_batches import declared_max_length, longest_batch, varying_batch_lines
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, TrialState
from autotuner.tuning.trials.trial import ExperimentSettings, scored

BASE, PER_POSITION = 400 * 2**20, 2 * 2**20  # bytes; the true peak of a step is BASE + PER_POSITION x length


def window(lengths_per_rank: list[list[int]], noise: float = 0.0, seed: int = 0) -> Measurement:
    """A launch's window as the engine records it: per step, its length and the peak so far (the
    allocator's on a GPU, the resident mark on a CPU), from a rank that held BASE before its first step."""
    rng = random.Random(seed)
    ranks = []
    for lengths in lengths_per_rank:
        so_far, rows = 0, []
        for length in lengths:
            so_far = max(so_far, int((BASE + PER_POSITION * length) * (1 + rng.uniform(-noise, noise))))
            rows.append((length, so_far))
        ranks.append(tuple(rows))
    peak = max(p for rank in ranks for _, p in rank)
    return Measurement(throughput=10.0, latency=0.1, peak_memory_bytes=peak, step_peaks=tuple(ranks),
                       bytes_before_first_step=BASE)


def test_the_peak_is_planned_at_the_declared_longest_batch():
    m = window([[30, 20, 45, 60, 35, 64], [50, 16, 55, 40, 62, 58]], noise=0.002)
    found = longest_batch(m, 256)
    assert found is not None and found.fitted
    assert (found.seen_min, found.seen_max, found.planned_length) == (16, 64, 256)
    assert found.planned_peak_bytes == pytest.approx(BASE + PER_POSITION * 256, rel=0.02)
    assert found.bytes_per_position == pytest.approx(PER_POSITION, rel=0.1)


def test_undeclared_the_plan_is_the_longest_seen_plus_the_spread():
    lengths = [[30, 20, 45, 60, 35, 64]]
    found = longest_batch(window(lengths), None)
    import statistics
    import math

    assert found.planned_length == 64 + math.ceil(statistics.pstdev(lengths[0]))
    assert found.planned_peak_bytes == pytest.approx(BASE + PER_POSITION * found.planned_length, rel=0.01)
    lines = varying_batch_lines([window(lengths)], None, "")
    assert lines and "20 to 64 positions" in lines[0] and "no maximum declared" in lines[0]


def test_fixed_lengths_change_nothing_and_one_record_scales_what_came_after_the_first_step():
    assert longest_batch(window([[64] * 5]), 256) is None
    assert longest_batch(Measurement(throughput=1.0, latency=1.0, peak_memory_bytes=10), 256) is None
    single = longest_batch(window([[64, 32, 32, 16]]), 128)  # no step after the first set a new longest batch
    assert not single.fitted
    # Every byte above what the rank held before its first step, in proportion to the length.
    assert single.planned_peak_bytes == BASE + PER_POSITION * 128


def test_the_maximum_is_read_from_the_config_or_the_scripts_flags():
    assert declared_max_length(("--max_seq_length", "512"), None) == (512, "the script's --max_seq_length")
    assert declared_max_length(("--block_size=1024", "--lr", "1"), None) == (1024, "the script's --block_size")
    assert declared_max_length(("--max_seq_length", "512"), 128) == (128, "autotuning.max_sequence_length")
    assert declared_max_length(("--lr", "1"), None) == (None, "")


def test_a_launch_within_budget_at_its_window_is_out_of_memory_at_its_longest_batch():
    settings = ExperimentSettings(script="t.py", script_args=(), base_config={}, nproc_per_node=2, data_parallel_size=2,
                                  objective=Objective("throughput"), timeout_s=60,
                                  memory_budget_bytes=BASE + PER_POSITION * 128, max_sequence_length=256)
    m = window([[30, 20, 45, 60, 35, 64]])
    common = dict(experiment=Experiment(0, 8), predicted_memory_bytes=None, wall_time_s=1.0)
    result = scored(m, settings, common)
    assert result.state is TrialState.OOM
    assert "at its longest batch (256 positions; the window saw up to 64)" in result.error
    shorter = scored(m, dataclasses.replace(settings, max_sequence_length=100), common)
    assert shorter.state is TrialState.OK
    assert shorter.measured_memory_bytes == pytest.approx(BASE + PER_POSITION * 100, rel=0.01)


def test_the_measurement_record_keeps_the_steps():
    m = window([[30, 20, 45]])
    again = Measurement.from_json(m.to_json())
    assert again.step_peaks == m.step_peaks and again.bytes_before_first_step == BASE
