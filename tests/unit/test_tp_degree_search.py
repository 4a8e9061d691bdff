"""Searching the tensor-parallel degree (issue 69): `tensor_parallel.autotp_size` "auto" or a list.
The degrees settled before any launch, each kept or left out saying why; one profile and search
per degree over its own launches (a degree's data-parallel size counts its batch), the pick
across all, its config at its degree; experiments named and recorded with the degree."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from autotuner.app.layout_checks import kept_layouts
from autotuner.app.tensor_parallel_checks import settled_degrees
from autotuner.tuning.space.layout import Layout
from autotuner.app.settle import check_some_batch_is_valid
from autotuner.config import load_config
from autotuner.core.boundary import Measurement
from autotuner.core.errors import ConfigError
from autotuner.tuning.space.config_space import search_space
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.ledger import TrialKind, TrialLedger
from autotuner.tuning.trials.trial import built_mismatch, experiment_config
from fakes import FakeRunner, MiB, experiment_settings, ok, orchestrator, profiled, settled


def tp_config(autotp_size, budget=4 * 2**30, **top):
    return load_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": [0, 1, 2]},
                        "tensor_parallel": {"autotp_size": autotp_size}, **top,
                        "autotuning": {"enabled": True, "memory_per_rank_bytes": budget, "tuner_type": "gridsearch",
                                       "history": False, "max_train_micro_batch_size_per_gpu": 4,
                                       "remeasure_rounds": 0}})


def test_an_experiment_carries_its_degree_in_its_name_config_record_and_tuned_values():
    at_two = Experiment(2, 8, 4, tensor_parallel=2)
    assert at_two.name == "z2_tp2_gas4_mbs8"
    assert Experiment(2, 8, 4).name == "z2_gas4_mbs8"  # a tune that sets no degree names none
    config = at_two.apply({"tensor_parallel": {"autotp_size": "auto", "tp_overlap_comm": False}}, 2)
    assert config["tensor_parallel"] == {"autotp_size": 2, "tp_overlap_comm": False}
    assert config["train_batch_size"] == 8 * 4 * 2  # the degree's data-parallel size, as given
    assert ("tensor_parallel.autotp_size", 2) in at_two.tuned_values()
    assert at_two.with_knobs({"overlap_comm": True}).tensor_parallel == 2
    record = TrialResult(at_two, TrialState.OK, value=1.0)
    assert TrialResult.from_json(record.to_json()).experiment == at_two
    assert at_two != Experiment(2, 8, 4, tensor_parallel=1)


def test_the_ranks_building_another_degree_fail_the_launch_and_0_and_1_are_the_same():
    settings = experiment_settings(tp_config(2))
    built = Measurement(throughput=1.0, latency=1.0, zero_stage=0, micro_batch_size=2, gradient_accumulation_steps=1,
                        built=(("tensor_parallel.autotp_size", 0),))
    assert built_mismatch(Experiment(0, 2, 1, tensor_parallel=1), built, settings) is None
    why = built_mismatch(Experiment(0, 2, 1, tensor_parallel=2), built, settings)
    assert why is not None and "tensor_parallel.autotp_size = 1, not the experiment's 2" in why


@pytest.mark.parametrize("given, ranks, per_node, degrees", [
    ("auto", 4, 4, (1, 2, 4)), ("auto", 8, 4, (1, 2, 4)), ("auto", 6, 6, (1, 2, 3, 6)), ([4, 2, 2], 4, 4, (2, 4)),
    (2, 4, 4, (2,)), (0, 4, 4, (1,))])
def test_the_degrees_searched_are_the_divisors_of_the_ranks_per_node_or_the_list(given, ranks, per_node, degrees):
    assert settled_degrees(tp_config(given), ranks, per_node, "ds.json") == degrees


def test_a_listed_degree_that_does_not_divide_the_ranks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"ds.json: tensor_parallel.autotp_size: 3 in \[1, 3\] does not divide the "
                                          r"number of ranks \(4\)"):
        settled_degrees(tp_config([1, 3]), 4, 4, "ds.json")


def test_a_degree_with_no_valid_global_batch_is_left_out_saying_why():
    said = []
    config = tp_config("auto", train_batch_size=4, gradient_accumulation_steps=4)  # mbs x 4 x dp = 4: dp 1 only
    space = search_space(config, 4)
    with pytest.raises(ConfigError, match="no micro-batch size gives a valid global batch"):
        kept_layouts(config, space, (Layout(1), Layout(2)), 4, "ds.json", said.append, check_some_batch_is_valid)
    kept, left_out = kept_layouts(config, space, (Layout(1), Layout(2), Layout(4)), 4, "ds.json", said.append,
                                  check_some_batch_is_valid)
    assert kept == (Layout(4),) and [layout.tensor_parallel for layout, _ in left_out] == [1, 2]
    assert said[0].startswith("tensor parallel 1: left out (train_batch_size (4): no micro-batch size gives")


def test_a_degree_reads_only_its_own_launches_from_the_one_ledger():
    ledger = TrialLedger()
    for degree in (1, 2):
        ledger.record(TrialResult(Experiment(0, 2, 1, tensor_parallel=degree), TrialState.OK, value=float(degree)),
                      kind=TrialKind.PROFILE)
    view = ledger.view(Layout(2))
    assert [r.value for r in view.results()] == [2.0] and [r.value for r in view.of_kind(TrialKind.PROFILE)] == [2.0]
    ledger.record(TrialResult(Experiment(2, 2, 1, tensor_parallel=2), TrialState.OK, value=3.0))
    assert len(ledger) == 3 and len(view) == 2 and len(ledger.view(Layout(1))) == 1  # the view filters the one ledger
    assert not hasattr(view, "record")  # a view reads; appending is the ledger's alone


def test_a_degree_search_profiles_each_degree_leaves_out_one_that_fails_and_picks_across_them(tmp_path):
    # 4 ranks, train_batch_size 16 fixed: at degree 2 the data-parallel size halves, so gas doubles.
    config = tp_config("auto", train_batch_size=16)
    settings = experiment_settings(config, nproc_per_node=4, data_parallel_size=4)
    speed = {1: 100.0, 2: 150.0}

    def answer(trial):
        degree = trial.experiment.tensor_parallel
        if degree == 4:
            return TrialResult(trial.experiment, TrialState.FAILED, error="rank 0: UnsupportedError: heads not divisible")
        return ok(trial, speed[degree] * trial.experiment.micro_batch_size, 200 * MiB)

    runner = FakeRunner(profiled(answer))
    lines = []
    place = settled(config, settings)
    space = place["space"].at_layout(Layout(1), 4)
    tuner = orchestrator(tmp_path, config, runner, settings, report=lines.append,
                         layouts=(Layout(1), Layout(2), Layout(4)), left_out=((Layout(8), "example"),), space=space)
    # (the fake's `settled` gives the space at no degree; the settle pass gives it at the first)
    outcome = tuner.tune()
    asked = {trial.experiment.tensor_parallel for trial in runner.trials}
    assert asked == {1, 2, 4}
    for trial in runner.trials:  # every launch's config: its degree, and the user's global batch kept
        written = experiment_config(trial.experiment, trial.settings)
        degree = trial.experiment.tensor_parallel
        assert written["tensor_parallel"]["autotp_size"] == degree
        assert trial.settings.data_parallel_size == 4 // degree
        assert trial.experiment.train_batch_size(4 // degree) == 16
    assert outcome.best.experiment.tensor_parallel == 2 and outcome.best.experiment.micro_batch_size == 4
    summary = outcome.summary
    assert "layout: tensor parallel 8: left out (example)" in summary
    assert "layout: tensor parallel 1 x data parallel 4: kept" in summary
    assert "layout: tensor parallel 2 x data parallel 2: kept" in summary and "best z0_tp2_gas2_mbs4" in summary
    assert "layout: tensor parallel 4: left out (the model did not run in the profile launch (failed): rank 0: " \
           "UnsupportedError: heads not divisible" in summary
    table = pd.read_csv(tmp_path / "results" / "experiments.csv")
    assert set(table["tp"]) == {1, 2, 4} and all(f"_tp{tp}_" in name for tp, name in zip(table["tp"], table["name"]))
    import json

    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal["tensor_parallel"]["autotp_size"] == 2
    assert (optimal["train_micro_batch_size_per_gpu"], optimal["gradient_accumulation_steps"]) == (4, 2)


def test_only_one_degree_left_fails_the_tune_as_before(tmp_path):
    config = tp_config([2])
    settings = experiment_settings(config, nproc_per_node=4, data_parallel_size=2)
    runner = FakeRunner(lambda trial: TrialResult(trial.experiment, TrialState.FAILED, error="boom"))
    place = settled(config, settings)
    tuner = orchestrator(tmp_path, config, runner, settings, layouts=(Layout(2),),
                         space=replace(place["space"], tensor_parallel=2))
    from autotuner.tuning.trials.evaluator import TuningFailed

    with pytest.raises(TuningFailed, match="the model did not run in the profile launch"):
        tuner.tune()


def _degree_search(tmp_path, speed, reach_mib=None):
    """A fake 4-rank search over degrees 1 and 2 at micro-batches up to 4: `speed[degree]` per
    sample; `reach_mib[degree]`: the peak per sample (a lower one fits larger micro-batches)."""
    config = tp_config([1, 2], budget=2**30)
    settings = experiment_settings(config, nproc_per_node=4, data_parallel_size=4, memory_budget_bytes=2**30)

    def answer(trial):
        per_sample = (reach_mib or {}).get(trial.experiment.tensor_parallel, 1)
        return ok(trial, speed[trial.experiment.tensor_parallel] * trial.experiment.micro_batch_size,
                  (200 + per_sample * trial.experiment.micro_batch_size) * MiB)

    runner = FakeRunner(profiled(answer))
    space = settled(config, settings)["space"].at_layout(Layout(1), 4)
    outcome = orchestrator(tmp_path, config, runner, settings, layouts=(Layout(1), Layout(2)), space=space).tune()
    return runner, outcome


def test_a_degree_that_reaches_no_larger_batch_and_measures_slower_is_profiled_only(tmp_path):
    runner, outcome = _degree_search(tmp_path, {1: 100.0, 2: 40.0})
    at_two = [trial for trial in runner.trials if trial.experiment.tensor_parallel == 2]
    assert at_two and all(trial.profile for trial in at_two)  # its profile launches, no search
    assert outcome.best.experiment.tensor_parallel == 1
    assert ("layout: tensor parallel 2 x data parallel 2: profiled, not searched (cannot help: tensor parallel 1 "
            "reaches as large a micro-batch at every stage and measured faster") in outcome.summary


def test_a_faster_degree_is_searched(tmp_path):
    runner, outcome = _degree_search(tmp_path, {1: 100.0, 2: 160.0})
    assert any(not trial.profile for trial in runner.trials if trial.experiment.tensor_parallel == 2)
    assert outcome.best.experiment.tensor_parallel == 2
    assert "layout: tensor parallel 2 x data parallel 2: kept" in outcome.summary


def test_a_slower_degree_that_fits_a_larger_micro_batch_is_searched_and_can_win(tmp_path):
    # Degree 1 holds 250 MiB a sample (micro-batch 2 at most in the 1 GiB budget), degree 2 50 MiB:
    # slower at each size both profiled, but its micro-batch 4 beats degree 1's best.
    runner, outcome = _degree_search(tmp_path, {1: 100.0, 2: 60.0}, reach_mib={1: 250, 2: 50})
    assert "layout: tensor parallel 2 x data parallel 2: kept" in outcome.summary
    assert outcome.best.experiment.tensor_parallel == 2 and outcome.best.experiment.micro_batch_size == 4


def _timed(trial, seconds_per_micro_step, throughput):
    """A launch measured as a real one is: forward and backward per micro-step, samples/s."""
    from autotuner.core.boundary import Summary

    third = seconds_per_micro_step / 3
    measurement = Measurement(throughput=throughput, latency=1.0 / throughput, peak_memory_bytes=200 * MiB,
                              forward=Summary.of([third]), backward=Summary.of([2 * third]))
    return TrialResult(trial.experiment, TrialState.OK, value=throughput, measurement=measurement,
                       predicted_memory_bytes=trial.predicted_memory_bytes, measured_memory_bytes=200 * MiB)


def _bounded_search(tmp_path, split_flop_share, bound_layouts=True, **probed):
    """Degree 1 on 4 ranks: forward + backward 10 ms a micro-step plus 10 ms a sample, 30 ms more a
    step; its best micro-batch 4 at 16 / 0.08 s. Degree 2 would run 1.3x degree 1's samples/s."""
    import dataclasses

    from fakes import model_info

    config = tp_config([1, 2])
    config = config.model_copy(update={"autotuning": config.autotuning.model_copy(update={"bound_layouts": bound_layouts})})
    settings = experiment_settings(config, nproc_per_node=4, data_parallel_size=4)

    def answer(trial):
        m = trial.experiment.micro_batch_size
        seconds = 0.01 + 0.01 * m
        speed = 1.3 if trial.experiment.tensor_parallel == 2 else 1.0
        result = _timed(trial, seconds, speed * 4 * m / (seconds + 0.03))
        if trial.profile:
            result = dataclasses.replace(result, model_info=model_info(m, trial.experiment.zero_stage,
                                                                       activation_bytes=m * MiB,
                                                                       split_flop_share=split_flop_share,
                                                                       **probed))
        return result

    runner = FakeRunner(answer)
    space = settled(config, settings)["space"].at_layout(Layout(1), 4)
    outcome = orchestrator(tmp_path, config, runner, settings, layouts=(Layout(1), Layout(2)), space=space).tune()
    return runner, outcome


def test_a_degree_whose_bound_from_degree_1_cannot_beat_its_best_is_never_launched(tmp_path):
    # 30% of the FLOPs split: at its largest micro-batch 4 on 2 replicas, degree 2's micro-step costs
    # at least 10 ms + (0.15 + 0.7) x 40 ms = 44 ms, so 8 / 0.044 = 181.8 samples/s, below degree 1's
    # best 200 by more than the noise floor.
    runner, outcome = _bounded_search(tmp_path, 0.3)
    assert not [t for t in runner.trials if t.experiment.tensor_parallel == 2]
    assert outcome.best.experiment.tensor_parallel == 1
    assert ("layout: tensor parallel 2 x data parallel 2: not profiled (cannot win: at most 181.8 samples/s from "
            "tensor parallel 1's launches at micro-batch 4 (30.0% of the forward's FLOPs split 2 ways, forward and "
            "backward 10 ms a micro-step + 10 ms a sample, its split layers' dispatch and all-reduces 0 ms a micro-step "
            "at the probe's floor; its optimizer step left out), against 200 measured at z0_tp1_gas1_mbs4)") in outcome.summary


def test_a_degree_whose_bound_could_win_is_profiled_searched_and_wins(tmp_path):
    # 95% split: the bound (8 / 0.031 = 258 samples/s) is above degree 1's best, so degree 2 is launched, and wins.
    runner, outcome = _bounded_search(tmp_path, 0.95)
    assert any(not t.profile for t in runner.trials if t.experiment.tensor_parallel == 2)
    assert outcome.best.experiment.tensor_parallel == 2
    assert "layout: tensor parallel 2 x data parallel 2: profiled (it may win: at most 258.1 samples/s" in outcome.summary


def test_a_degree_whose_all_reduces_alone_make_it_slower_is_never_launched(tmp_path):
    # 95% split would reach 258 samples/s, but 4 row-wise layers all-reduce twice a micro-step on
    # pairs that never took under 2 ms: 16 ms more a micro-step, 8 / 0.047 = 170 samples/s.
    from autotuner.core.probe_records import CollectiveTiming

    pairs = tuple(CollectiveTiming("all_reduce", size, seconds, 2) for size, seconds in ((2**12, 2e-3), (2**16, 3e-3)))
    runner, outcome = _bounded_search(tmp_path, 0.95, split_row_layers=4, collective_timings=pairs)
    assert not [t for t in runner.trials if t.experiment.tensor_parallel == 2]
    assert ("not profiled (cannot win: at most 170.2 samples/s from tensor parallel 1's launches at micro-batch 4 "
            "(95.0% of the forward's FLOPs split 2 ways, forward and backward 10 ms a micro-step + 10 ms a sample, its "
            "split layers' dispatch and all-reduces 16 ms a micro-step at the probe's floor;") in outcome.summary


def test_a_degree_whose_split_layers_dispatch_makes_it_slower_is_never_launched(tmp_path):
    # The probe's floor: a split column layer at least 3 ms over the same layer unsplit and a row layer
    # 2 ms on the pairs; 4 column and 2 row layers a micro-step add 16 ms, as the all-reduces alone did
    # above. Back to back they took twice that, which the bound leaves to the prediction; and the
    # all_reduce floor (1 ms) is not counted again: the split layers' own timing holds it.
    from autotuner.core.probe_records import CollectiveTiming, SplitLayerTiming

    pairs = (CollectiveTiming("all_reduce", 2**12, 1e-3, 2),)
    split = tuple(SplitLayerTiming(style, degree, 2 * seconds, 0.5e-3, 1024, 1e-3, 1e-3, seconds, 0.5e-3)
                  for style, degree, seconds in (("colwise", 2, 3.5e-3), ("rowwise", 2, 2.5e-3), ("colwise", 4, 9e-3),
                                                 ("rowwise", 4, 9e-3)))
    runner, outcome = _bounded_search(tmp_path, 0.95, split_row_layers=2, split_col_layers=4, collective_timings=pairs,
                                      split_layer_timings=split)
    assert not [t for t in runner.trials if t.experiment.tensor_parallel == 2]
    assert ("not profiled (cannot win: at most 170.2 samples/s from tensor parallel 1's launches at micro-batch 4 "
            "(95.0% of the forward's FLOPs split 2 ways, forward and backward 10 ms a micro-step + 10 ms a sample, its "
            "split layers' dispatch and all-reduces 16 ms a micro-step at the probe's floor;") in outcome.summary


def test_with_bound_layouts_false_a_degree_that_cannot_win_is_profiled_all_the_same(tmp_path):
    # The fake runs degree 2 1.3x faster than degree 1, beyond what its 30% split share allows: profiled
    # all the same, its launches measure it, and it wins.
    runner, outcome = _bounded_search(tmp_path, 0.3, bound_layouts=False)
    assert [t for t in runner.trials if t.experiment.tensor_parallel == 2 and t.profile]
    assert outcome.best.experiment.tensor_parallel == 2
    assert ("layout: tensor parallel 2 x data parallel 2: profiled all the same, autotuning.bound_layouts false "
            "(cannot win: at most 181.8 samples/s") in outcome.summary


def test_the_bound_needs_two_timed_micro_batch_sizes_and_takes_no_cost_per_sample_below_zero():
    from autotuner.tuning.searches.degree_bound import degree_bound, micro_step_line

    class Trial:
        predicted_memory_bytes = None

        def __init__(self, m):
            self.experiment = Experiment(0, m, 1, tensor_parallel=1)

    def launch(m, seconds):
        trial = Trial(m)
        return _timed(trial, seconds, 4 * m / seconds)

    assert micro_step_line([launch(2, 0.03)]) is None  # one size: no line
    # Times that fall with the micro-batch: a micro-step costs at least the fastest, nothing per sample.
    assert micro_step_line([launch(1, 0.05), launch(2, 0.04)]) == (0.04, 0.0)
    # The fastest launch at each size decides: 20 ms at 1, 30 at 2 (the 90 ms one aside), 50 at 4.
    results = [launch(1, 0.02), launch(2, 0.09), launch(2, 0.03), launch(4, 0.05)]
    assert micro_step_line(results) == pytest.approx((0.01, 0.01))
    bound = degree_bound(4, 0.5, 1, 4, results)  # 4 ranks at degree 4: one replica
    assert bound.bound_samples_per_s == pytest.approx(4 / (0.01 + (0.5 / 4 + 0.5) * 0.01 * 4))
    assert bound.best_samples_per_s == pytest.approx(4 * 4 / 0.05) and bound.best_name == "z0_tp1_gas1_mbs4"
    assert bound.cannot_win
    assert degree_bound(4, 0.0, 1, 4, results) is None and degree_bound(1, 0.5, 4, 4, results) is None


def test_a_backward_held_by_the_reduction_counts_as_twice_its_forward_below_zero_3():
    from autotuner.core.boundary import Summary
    from autotuner.tuning.searches.degree_bound import micro_step_line

    def launch(stage, m, forward, backward):
        measurement = Measurement(throughput=1.0, latency=1.0, forward=Summary.of([forward]),
                                  backward=Summary.of([backward]))
        return TrialResult(Experiment(stage, m, 1, tensor_parallel=1), TrialState.OK, value=1.0,
                           measurement=measurement)

    # At ZeRO 0 a 50 ms backward after a 10 ms forward counts 30 ms; ZeRO 3's sum counts as it is.
    assert micro_step_line([launch(0, 1, 0.01, 0.05), launch(0, 2, 0.02, 0.10)]) == pytest.approx((0.0, 0.03))
    assert micro_step_line([launch(3, 1, 0.01, 0.05), launch(3, 2, 0.02, 0.10)]) == pytest.approx((0.0, 0.06))
