"""Tuning the pipeline stages (issue 79): the layout an experiment sets, named, written and read
back; the layouts a tune runs, settled before any launch (the stages reach the script through
arg_mappings), each kept or left out saying why; the memory model stage by stage, the heaviest
stage deciding, the micro-batches in flight by schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotuner.app.layout_checks import kept_layouts, settled_layouts
from autotuner.app.settle import check_some_batch_is_valid
from autotuner.config import load_config
from autotuner.core.boundary import Measurement
from autotuner.core.errors import ConfigError
from autotuner.tuning.memory.estimate import ModelProfile, StageSettings, estimate
from autotuner.tuning.memory.pipeline_stages import in_flight
from autotuner.tuning.space.config_space import search_space
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.trial import built_mismatch
from fakes import experiment_settings


def pipe_config(stages="auto", mapped=True, pipeline_extra=None, **top):
    given = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 16, "zero_optimization": {"stage": [0, 1, 2]}}
    given.update(top)
    given = {key: value for key, value in given.items() if value is not None}  # None: left out
    return load_config({**given, "pipeline": {"stages": stages, **(pipeline_extra or {})},
                        "autotuning": {"enabled": True, "tuner_type": "gridsearch", "history": False,
                                       "max_train_micro_batch_size_per_gpu": 4,
                                       "arg_mappings": {"pipeline.stages": "-p"} if mapped else {}}})


def test_an_experiment_carries_its_layout_in_its_name_config_record_and_tuned_values():
    both = Experiment(1, 2, 8, tensor_parallel=2, pipeline=2)
    assert both.name == "z1_pp2_tp2_gas8_mbs2" and both.layout == Layout(2, 2)
    assert Experiment(0, 4, 2, pipeline=4).name == "z0_pp4_gas2_mbs4"
    config = both.apply({"pipeline": {"stages": "auto", "schedule": "GPipe"}}, 1)
    assert config["pipeline"] == {"stages": 2, "schedule": "GPipe"} and config["tensor_parallel"]["autotp_size"] == 2
    assert ("pipeline.stages", 2) in both.tuned_values() and ("tensor_parallel.autotp_size", 2) in both.tuned_values()
    assert both.with_knobs({"x": 1}).layout == both.layout
    assert TrialResult.from_json(TrialResult(both, TrialState.OK, value=1.0).to_json()).experiment == both
    assert Layout(0, 2).text() == "pipeline 2" and Layout(2, 0).text() == "tensor parallel 2"
    assert Layout(2, 2).text() == "pipeline 2 x tensor parallel 2" and Layout(2, 4).model_ranks == 8


def test_the_ranks_must_build_the_stages_the_experiment_set():
    settings = experiment_settings(pipe_config(), arg_mappings={"pipeline.stages": "-p"})
    built = Measurement(throughput=1.0, latency=1.0, zero_stage=0, micro_batch_size=2, gradient_accumulation_steps=4,
                        built=(("pipeline.stages", 1),))
    assert built_mismatch(Experiment(0, 2, 4, pipeline=1), built, settings) is None
    why = built_mismatch(Experiment(0, 2, 4, pipeline=2), built, settings)
    assert why is not None and "pipeline.stages = 1, not the experiment's 2" in why and "mapped flag -p" in why


def test_the_ranks_must_build_the_schedule_a_tune_searching_it_set():
    # Under "schedule": "auto" the schedule is a tuned value: in the launch's request (so a script that
    # builds its config in code is given it) and checked against what the ranks report building.
    from autotuner.config.tuned_values import lay_tuned_values
    from autotuner.tuning.trials.trial import Trial

    searched = {"pipeline": {"stages": [2], "schedule": "auto"}}
    one, interleaved = Experiment(0, 2, 4, pipeline=2), Experiment(0, 2, 4, pipeline=2, stages_per_rank=2)
    assert ("pipeline.schedule", "1F1B") in one.tuned_values_in(searched)
    assert ("pipeline.schedule", "Interleaved1F1B") in interleaved.tuned_values_in(searched)
    assert one.tuned_values_in({"pipeline": {"stages": [2], "schedule": "GPipe"}}) == one.tuned_values()  # named: the config's
    assert Experiment(0, 2, 4).tuned_values_in(searched) == Experiment(0, 2, 4).tuned_values()  # no pipeline set
    settings = experiment_settings(pipe_config(), arg_mappings={"pipeline.stages": "-p"})
    settings = type(settings)(**{**settings.__dict__, "base_config": {**settings.base_config, **searched}})
    request = Trial(one, Path("exp"), settings).request()
    assert request.tuned_values()["pipeline.schedule"] == "1F1B"
    laid, changes = lay_tuned_values({"pipeline": {"schedule": "GPipe"}}, request.tuned_values())
    assert laid["pipeline"]["schedule"] == "1F1B" and "pipeline.schedule: 'GPipe' -> '1F1B'" in changes

    def built(schedule):
        return Measurement(throughput=1.0, latency=1.0, zero_stage=0, micro_batch_size=2, gradient_accumulation_steps=4,
                           built=(("pipeline.stages", 2), ("pipeline.schedule", schedule)))

    assert built_mismatch(one, built("1F1B"), settings) is None
    why = built_mismatch(one, built("GPipe"), settings)
    assert why is not None and "pipeline.schedule = 'GPipe', not the experiment's '1F1B'" in why


@pytest.mark.parametrize("stages, mapped, layouts, searched", [
    ("auto", True, (Layout(0, 1), Layout(0, 2), Layout(0, 4)), True),
    ([4, 2, 2], True, (Layout(0, 2), Layout(0, 4)), True),
    (2, True, (Layout(0, 2),), False),  # fixed by the tune: every experiment passes it
    ("auto", False, (Layout(),), False),  # DeepSpeed's meaning: the script's PipelineModule decides
    (2, False, (Layout(),), False),
])
def test_the_stages_searched_are_the_divisors_of_the_ranks_or_the_list_where_they_reach_the_script(
        stages, mapped, layouts, searched):
    assert settled_layouts(pipe_config(stages, mapped), 4, 4, "ds.json") == (layouts, searched)


def test_stages_with_tensor_parallel_degrees_cross_as_layouts_each_keeping_zero_0_and_1():
    config = pipe_config([1, 2], tensor_parallel={"autotp_size": [1, 2]})
    layouts, searched = settled_layouts(config, 4, 4, "ds.json")
    assert searched and layouts == (Layout(1, 1), Layout(2, 1), Layout(1, 2), Layout(2, 2))
    said = []
    kept, left_out = kept_layouts(config, search_space(config, 4), layouts, 4, "ds.json", said.append,
                                  check_some_batch_is_valid)
    assert kept == layouts and left_out == ()
    space = search_space(config, 4)
    assert space.at_layout(Layout(2, 2), 4).stages == (0, 1) == space.at_layout(Layout(1, 2), 4).stages
    assert space.at_layout(Layout(2, 2), 4).experiment(0, 2).name == "z0_pp2_tp2_gas8_mbs2"  # 16 = 2 x 8 x 1
    assert said[-1].startswith("layouts: searching pipeline 1 x tensor parallel 1, pipeline 1 x tensor parallel 2")


def test_a_pipeline_keeps_zero_0_and_1_and_no_further_dimension():
    space = search_space(pipe_config(), 4)
    at = space.at_layout(Layout(0, 2), 4)
    assert at.stages == (0, 1) and at.data_parallel_size == 2 and at.pipeline == 2
    assert at.experiment(1, 2) == Experiment(1, 2, 4, pipeline=2)  # gas 4: 16 = 2 x 4 x 2
    with pytest.raises(ConfigError, match="ZeRO 2 and 3 are not supported with pipeline parallelism"):
        config = pipe_config(zero_optimization={"stage": 3})
        kept_layouts(config, search_space(config, 4), (Layout(0, 2),), 4, "ds.json", lambda line: None,
                     check_some_batch_is_valid)


@pytest.mark.parametrize("schedule, stage, stages, micro, held", [
    ("1F1B", 0, 4, 8, 4), ("1F1B", 3, 4, 8, 1), ("1F1B", 1, 4, 2, 2), ("GPipe", 3, 4, 8, 8), ("1F1B", 0, 2, 1, 1)])
def test_the_micro_batches_in_flight_on_a_stage_follow_the_schedule(schedule, stage, stages, micro, held):
    assert in_flight(schedule, stage, stages, micro) == held


def _torchs_peak_chunk_forwards(schedule_class, stages: int, per_rank: int, micro_batches: int, rank: int) -> int:
    """The most chunk forwards awaiting their backward on `rank`, walked through torch's own action
    list for the schedule (its rank-op builder, without process groups). A zero-bubble schedule's
    chunk keeps its graph till its weight gradient (torch's input-gradient half retains it)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    schedule = object.__new__(schedule_class)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = stages, per_rank, micro_batches
    schedule._stages = [None] * per_rank
    schedule.number_of_rounds = max(1, micro_batches // stages)
    schedule.microbatches_per_round = micro_batches // schedule.number_of_rounds
    held = peak = 0
    for action in schedule._calculate_single_rank_operations(rank):
        if action is not None and action.computation_type == _ComputationType.FORWARD:
            held += 1
        elif action is not None and action.computation_type in (_ComputationType.FULL_BACKWARD,
                                                                 _ComputationType.BACKWARD_WEIGHT):
            held -= 1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_the_chunk_forwards_in_flight_under_several_stages_a_rank_are_torchs_own(name):
    # Every rank of 2 and 4 stages, 2 and 3 chunks a rank, 1 to 16 micro-batches in whole rounds:
    # the memory model's count (micro-batches' worth, so times the chunks) against torch's schedule.
    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        ScheduleLoopedBFS)

    cls = {"Interleaved1F1B": ScheduleInterleaved1F1B, "LoopedBFS": ScheduleLoopedBFS,
           "InterleavedZeroBubble": ScheduleInterleavedZeroBubble}[name]
    checked = 0
    for stages in (2, 4):
        for per_rank in (2, 3):
            for micro in sorted({1, 2, stages, 2 * stages, 3 * stages, 4 * stages}):
                if micro % max(1, micro // stages):
                    continue
                for rank in range(stages):
                    torch_says = _torchs_peak_chunk_forwards(cls, stages, per_rank, micro, rank)
                    assert in_flight(name, rank, stages, micro, per_rank) * per_rank == torch_says, \
                        (stages, per_rank, micro, rank)
                    checked += 1
    assert checked == 68
    # Interleaved holds more than 1F1B on the first stage (2.5 micro-batches' worth against 2 here).
    assert in_flight("Interleaved1F1B", 0, 2, 4, 2) == 2.5 and in_flight("1F1B", 0, 2, 4) == 2


def test_schedule_auto_searches_1f1b_and_interleaved_1f1b_as_layouts_of_their_own():
    layouts, searched = settled_layouts(pipe_config([2], pipeline_extra={"schedule": "auto"}), 4, 4, "ds.json")
    assert layouts == (Layout(0, 2), Layout(0, 2, 2)) and searched
    layouts, _ = settled_layouts(pipe_config("auto", pipeline_extra={"schedule": "auto", "stages_per_rank": 3}),
                                 4, 4, "ds.json")
    # (one pipeline rank has nothing to interleave: pipeline 1 once)
    assert layouts == (Layout(0, 1), Layout(0, 2), Layout(0, 2, 3), Layout(0, 4), Layout(0, 4, 3))
    fixed, _ = settled_layouts(pipe_config([2], pipeline_extra={"schedule": "LoopedBFS"}), 4, 4, "ds.json")
    assert fixed == (Layout(0, 2, 2),)
    interleaved = Experiment(0, 2, 4, pipeline=2, stages_per_rank=2)
    assert interleaved.name == "z0_pp2v2_gas4_mbs2" and interleaved.layout.text() == "pipeline 2 (2 stages per rank)"
    written = interleaved.apply({"pipeline": {"stages": [2], "schedule": "auto"}}, 2)["pipeline"]
    assert written == {"stages": 2, "schedule": "Interleaved1F1B", "stages_per_rank": 2}
    assert Experiment(0, 2, 4, pipeline=2).apply({"pipeline": {"schedule": "auto"}}, 2)["pipeline"]["schedule"] == "1F1B"
    assert ("pipeline.stages_per_rank", 2) in interleaved.tuned_values()
    record = TrialResult(interleaved, TrialState.OK, 1.0)
    assert TrialResult.from_json(record.to_json()).experiment == interleaved
    # torch's Interleaved1F1B runs whole rounds only: gas 6 over 4 stages (rounds of 6 // 4 = 1) runs,
    # gas 10 over 4 (2 rounds of 5) runs, gas 9 over 4 (2 rounds) cannot and is no candidate.
    space = search_space(pipe_config([4], train_batch_size=None, gradient_accumulation_steps=9), 4)
    assert space.at_layout(Layout(0, 4), 4).gas(1) == 9 and space.at_layout(Layout(0, 4, 2), 4).gas(1) is None


@pytest.mark.parametrize("pipeline, mapped, message", [
    ({"schedule": "auto"}, False, 'pipeline.schedule "auto": a tune searches the schedule with the stages'),
    ({"schedule": "auto", "stages_per_rank": 1}, True, "pipeline.stages_per_rank 1: \"auto\" searches 1F1B against"),
    ({"schedule": "ZBVZeroBubble"}, True, "ZBVZeroBubble: a tune does not cost a V's placement"),
    ({"schedule": "DualPipeV"}, True, "DualPipeV: a tune does not cost a V's placement"),
    ({"stages_per_rank": 2}, True, "pipeline.stages_per_rank 2: schedule '1F1B' runs one stage per rank")])
def test_what_a_tune_of_the_schedule_cannot_cost_is_refused_in_one_line(pipeline, mapped, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        settled_layouts(pipe_config("auto", mapped=mapped, pipeline_extra=pipeline), 4, 4, "ds.json")


def test_the_step_time_model_counts_the_bubble_over_the_chunks():
    from autotuner.tuning.models.cost_model import stage_steps

    assert stage_steps(Experiment(0, 2, 8, pipeline=4)) == 8 + 3
    assert stage_steps(Experiment(0, 2, 8, pipeline=4, stages_per_rank=2)) == 8 + 1.5
    assert stage_steps(Experiment(0, 2, 8)) == 8


def test_the_memory_model_costs_each_stage_and_the_heaviest_decides():
    # Stage 0 holds fewer parameters but, under 1F1B, two micro-batches of activations; stage 1 one.
    profile = ModelProfile(num_params=3000, activation_bytes_per_sample=0, baseline_bytes=1000,
                           pipeline_stage_params=(1000, 2000), pipeline_stage_activation_bytes_per_sample=(500, 500))
    settings = StageSettings(0, "fp32", 1, gradient_accumulation_steps=8)
    one_f_one_b = estimate(profile, settings, micro_batch_size=10)
    # stage 0: 1000 x (4 + 4 + 8) + 500 x 10 x 2 = 26000; stage 1: 2000 x 16 + 500 x 10 = 37000 (+ baseline)
    assert one_f_one_b.total == 37000 + 1000
    gpipe = estimate(profile.__class__(**{**profile.__dict__, "pipeline_schedule": "GPipe"}), settings, 10)
    assert gpipe.total == 2000 * 16 + 500 * 10 * 8 + 1000  # every stage holds all 8: the larger one decides
    sharded = estimate(profile, StageSettings(1, "fp32", 2, gradient_accumulation_steps=8), 10)
    assert sharded.optimizer_states == 2000 * 8 // 2  # ZeRO 1 over the stage's two replicas


def test_our_plain_engine_reports_no_pipeline_whatever_its_config_says():
    # A script that took the mapped --pp flag and built a plain model: the ranks report 0 stages, so
    # the launch fails as built otherwise rather than being recorded as the experiment's pipeline.
    from types import SimpleNamespace

    from autotuner.runtime.measure.measurement import OurEngineView

    config = SimpleNamespace(dump=lambda by_alias: {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 0}})
    built = OurEngineView(SimpleNamespace(config=config)).built_values(["pipeline.stages"])
    assert built == (("pipeline.stages", 0),)
    settings = experiment_settings(pipe_config(), arg_mappings={"pipeline.stages": "--pp"})
    measured = Measurement(throughput=1.0, latency=1.0, zero_stage=0, micro_batch_size=2, gradient_accumulation_steps=4,
                           built=built)
    why = built_mismatch(Experiment(0, 2, 4, pipeline=2), measured, settings)
    assert why is not None and "pipeline.stages = 0, not the experiment's 2" in why
