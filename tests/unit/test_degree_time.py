"""A tensor-parallel degree's step time predicted from degree 1's launches (issue 80, part 1):
tuning/models/degree_time.py and the summary's lines (searches/degree_time_check.py)."""

from __future__ import annotations

import pytest

from autotuner.core.boundary import Measurement, Summary
from autotuner.core.probe_records import CollectiveTiming
from autotuner.tuning.models.degree_time import degree_time_model
from autotuner.tuning.searches.degree_time_check import degree_time_lines
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState
from fakes import model_info

# all_reduce on groups of 2: 1 ms + 1 ns a byte; on the whole group of 4: 2 ms + 2 ns a byte.
PAIRS = tuple(CollectiveTiming("all_reduce", size, 1e-3 + 1e-9 * size, 2) for size in (2**12, 2**16, 2**20))
WORLD = tuple(CollectiveTiming("all_reduce", size, 2e-3 + 2e-9 * size) for size in (2**16, 2**20, 2**22))


def launch(m, gas, latency, forward, backward, step=0.004, degree=1, info=None):
    measurement = Measurement(throughput=4 * m * gas / latency, latency=latency, forward=Summary.of([forward]),
                              backward=Summary.of([backward]), step=Summary.of([step]))
    return TrialResult(Experiment(0, m, gas, tensor_parallel=degree), TrialState.OK, value=measurement.throughput,
                       measurement=measurement, model_info=info)


def degree_one():
    """Forward + backward 2 ms + 3 ms a sample (a third of it forward), 1 ms a micro-step besides,
    a 4 ms optimizer step. 80% of the FLOPs split; 4 row-wise layers, 8 KiB of outputs a sample."""
    info = model_info(2, 0, trainable_num_params=1000, split_flop_share=0.8, split_row_layers=4,
                      split_row_output_bytes=2 * 8192, collective_timings=PAIRS + WORLD)
    results = []
    for m, gas in ((1, 4), (2, 2), (4, 1)):
        micro = 0.002 + 0.003 * m
        results.append(launch(m, gas, gas * (micro + 0.001) + 0.004, micro / 3, 2 * micro / 3,
                              info=info if m == 2 else None))
    return results


def test_a_degree_is_costed_from_degree_1s_line_its_split_share_and_its_groups_all_reduces():
    model = degree_time_model(degree_one(), world_size=4)
    assert (model.fixed_s, model.per_sample_s) == pytest.approx((0.002, 0.003))
    assert model.other_per_micro_step_s == pytest.approx(0.001) and model.optimizer_step_s == pytest.approx(0.004)
    step = model.predict(Experiment(0, 2, 4, tensor_parallel=2), params_per_rank=600)
    # a micro-step: 2 ms + (0.4 + 0.2) x 3 ms x 2; 8 all-reduces of 2 x 8192 / 4 bytes on pairs
    assert step.compute_s == pytest.approx(4 * (0.002 + 0.6 * 0.003 * 2))
    assert step.tensor_parallel_s == pytest.approx(4 * 8 * (1e-3 + 1e-9 * 4096))
    assert step.other_s == pytest.approx(4 * 0.001 + 0.004 * 600 / 1000)
    at_four = model.predict(Experiment(0, 2, 8, tensor_parallel=4), params_per_rank=400)  # the whole group's link
    assert at_four.tensor_parallel_s == pytest.approx(8 * 8 * (2e-3 + 2e-9 * 4096))
    assert model.predict(Experiment(1, 2, 4, tensor_parallel=2), 600) is None  # ZeRO 0 only
    assert model.predict(Experiment(0, 2, 4, tensor_parallel=8), 600) is None  # no group of 8 timed


def test_nothing_is_predicted_without_the_split_share_or_the_groups_timings():
    results = degree_one()
    bare = [TrialResult(r.experiment, r.state, r.value, measurement=r.measurement) for r in results]
    assert degree_time_model(bare, 4) is None
    assert degree_time_model(results[:1], 4) is None  # one micro-batch size: no line


def test_the_first_launch_checks_the_prediction_and_the_next_is_refitted_by_its_excess():
    model = degree_time_model(degree_one(), 4)
    first, second = Experiment(0, 1, 8, tensor_parallel=2), Experiment(0, 2, 4, tensor_parallel=2)
    predicted = [model.predict(e, 600).total_s for e in (first, second)]
    # Each micro-step measured 10 ms over the prediction (DTensor's dispatch, say).
    measured = [launch(e.micro_batch_size, e.gradient_accumulation_steps, p + 0.010 * e.gradient_accumulation_steps,
                       0.001, 0.002, degree=2) for e, p in zip((first, second), predicted)]
    lines = degree_time_lines(Layout(2), Layout(1), degree_one(), 600, measured, 4)
    assert len(lines) == 2
    assert lines[0].startswith("tensor parallel 2: z0_tp2_gas8_mbs1 step predicted from tensor parallel 1's launches "
                               f"at {1e3 * predicted[0]:.1f} ms")
    assert lines[0].endswith(f"measured {1e3 * (predicted[0] + 0.08):.1f} ms "
                             f"({100 * (predicted[0] - predicted[0] - 0.08) / (predicted[0] + 0.08):+.1f}%)")
    assert ("z0_tp2_gas4_mbs2 step predicted from tensor parallel 1's launches and its own 1 before (+10.0 ms a "
            "micro-step)") in lines[1]
    assert lines[1].endswith("(+0.0%)")


def test_small_all_reduces_that_do_not_grow_with_size_are_costed_at_their_median():
    flat = tuple(CollectiveTiming("all_reduce", size, seconds, 2) for size, seconds in
                 ((2**12, 3e-3), (2**16, 1e-3), (2**20, 1.2e-3)))
    results = degree_one()
    info = results[1].model_info
    from dataclasses import replace

    results[1] = replace(results[1], model_info=replace(info, collective_timings=flat + WORLD))
    link = degree_time_model(results, 4).links[2]
    assert link.latency_s == pytest.approx(1.2e-3) and link.bytes_per_s == pytest.approx(2**20 / 1.2e-3)


def test_each_split_layer_adds_what_the_probe_timed_it_adding_and_its_all_reduce_past_the_probes_size():
    # The probe timed on the pairs a split column layer 3 ms over the unsplit one and a row layer 2 ms,
    # at 1 KiB all-reduces; 8 column and 4 row layers a micro-step, each all-reducing 4 KiB at micro-batch 2.
    from autotuner.core.probe_records import SplitLayerTiming

    # Their parameters' optimizer step: 0.5 ms more a column layer, 0.25 a row layer.
    # (Their floors, which only the bound takes, lower.)
    split = (SplitLayerTiming("colwise", 2, 3.5e-3, 0.5e-3, 1024, 1.5e-3, 1e-3, 1e-3, 0.5e-3),
             SplitLayerTiming("rowwise", 2, 2.5e-3, 0.5e-3, 1024, 1.25e-3, 1e-3, 1e-3, 0.5e-3))
    results = degree_one()
    info = model_info(2, 0, trainable_num_params=1000, split_flop_share=0.8, split_row_layers=4, split_col_layers=8,
                      split_row_output_bytes=2 * 8192, collective_timings=PAIRS + WORLD, split_layer_timings=split)
    results[1] = TrialResult(results[1].experiment, results[1].state, results[1].value,
                             measurement=results[1].measurement, model_info=info)
    model = degree_time_model(results, world_size=4)
    step = model.predict(Experiment(0, 2, 4, tensor_parallel=2), params_per_rank=600)
    assert step.tensor_parallel_s == pytest.approx(4 * (8 * 3e-3 + 4 * 2e-3 + 12 * 1e-9 * (4096 - 1024)))
    assert step.other_s == pytest.approx(4 * 0.001 + 0.004 * 600 / 1000 + 8 * 0.5e-3 + 4 * 0.25e-3)
    # Degree 4 was not timed by the split probe: its all-reduces alone, as from an older profile.
    at_four = model.predict(Experiment(0, 2, 8, tensor_parallel=4), params_per_rank=400)
    assert at_four.tensor_parallel_s == pytest.approx(8 * 8 * (2e-3 + 2e-9 * 4096))


def test_a_split_layer_timing_survives_its_file_and_a_damaged_one_is_refused():
    from autotuner.core.boundary import ModelInfo, RecordError
    from autotuner.core.probe_records import SplitLayerTiming

    timing = SplitLayerTiming("rowwise", 4, 2e-3, 1e-3, 1024, 3e-3, 1e-3, 1.5e-3, 1e-3)
    info = model_info(2, 0, split_col_layers=3, split_layer_timings=(timing,))
    again = ModelInfo.from_json(info.to_json())
    assert again.split_layer_timings == (timing,) and again.split_col_layers == 3
    assert (timing.extra_s, timing.step_extra_s, timing.floor_extra_s) == pytest.approx((1e-3, 2e-3, 0.5e-3))
    assert SplitLayerTiming("colwise", 2, 1e-3, 2e-3, 1024, 1e-3, 1e-3, 1e-3, 1e-3).extra_s == 0.0  # never below zero
    with pytest.raises(RecordError, match="unknown style 'diagonal'"):
        SplitLayerTiming("diagonal", 2, 1e-3, 1e-3, 1024, 1e-3, 1e-3, 1e-3, 1e-3)
    with pytest.raises(RecordError, match="step_seconds must be finite and > 0"):
        SplitLayerTiming("colwise", 2, 1e-3, 1e-3, 1024, float("nan"), 1e-3, 1e-3, 1e-3)
    with pytest.raises(RecordError, match="split layer timing without 'step_seconds'"):
        SplitLayerTiming.from_json({key: value for key, value in timing.to_json().items() if key != "step_seconds"})
