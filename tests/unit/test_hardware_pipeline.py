"""A pipeline planned for hardware that is not here (issue 80, part 3; app/pipeline_plan.py,
tuning/models/hardware_pipeline.py): the census' layers split into stages by the module's
partition_method, each rank's operators, parameters (a tied module on each rank that runs it) and
activations; the step paced by the slowest rank over gas micro-steps, the fill and drain at the
others' pace (gas + (pp - 1) / v micro-steps where the ranks are equal); what a plan
does not cost refused in one line."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from autotuner.app.pipeline_plan import (LayerCount, PipelineCensus, check_pipeline_costed, pipeline_degrees,
                                         pipeline_ranks, pipeline_schedules)
from autotuner.config.hardware import parse_hardware
from autotuner.core.errors import ConfigError
from autotuner.runtime.measure.op_census import OpRecord
from autotuner.tuning.models.hardware_pipeline import PipelineRanks, pipeline_step_prediction
from autotuner.tuning.models.hardware_step import ADAM_BYTES_PER_PARAMETER

SPEC = {"name": "A100 SXM 80GB", "peak_bf16_flops": 312e12, "memory_bytes": 85899345920,
        "memory_bandwidth": 2.039e12, "accelerators_per_node": 8,
        "intra_node": {"bandwidth": 300e9, "latency": 5e-6}, "inter_node": {"bandwidth": 25e9, "latency": 10e-6}}


def _census(saved_scale: int) -> PipelineCensus:
    """Embedding (tied), four blocks, a norm, the tied head: as tests/workers/pipe_gpt_train.py builds."""
    def layer(name, trainable, held, tied=None, saved=0, out=100):
        return LayerCount(name, trainable, held, 1 if held else 0, tied, saved * saved_scale, out * saved_scale)

    layers = (layer("Embed", 1000, 0, "embed", 1), *[layer("Block", 500, 500, saved=10) for _ in range(4)],
              layer("LayerNorm", 10, 10, saved=2), layer("Embed", 1000, 0, "embed", 3, out=400))
    return PipelineCensus(layers, {"embed": (1000, 1)}, "parameters", 1, 0)


def _records() -> list[OpRecord]:
    forward = [OpRecord("aten.mm", 1e9 * (i + 1), 0.0, "forward", i) for i in range(7)]
    return [*forward, OpRecord("aten.nll_loss", 0.0, 0.0, "forward", None),
            OpRecord("aten.mm", 5e10, 0.0, "backward", None)]


def test_the_layers_split_by_their_parameters_and_a_tied_module_is_held_by_each_rank_that_runs_it():
    one, two = _census(1), _census(2)
    ranks, per_sample, backward = pipeline_ranks(one, two, _records(), pp=2, v=1, micro=3)
    # "parameters": 1000 | 500 500 500 500 | 10 1000 balanced as [embed, block, block] [block, block, norm, head]
    assert ranks.params == (1000 + 500 + 500, 500 + 500 + 10 + 1000)
    assert ranks.tied_params == 1000  # on both ranks: its gradients are summed over them
    assert [[r.block for r in rank] for rank in ranks.forward] == [[0, 1, 2], [3, 4, 5, 6, None]]  # the loss last
    assert [r.op for r in backward] == ["aten.mm"]
    assert per_sample == (1 + 10 + 10, 10 + 10 + 2 + 3)  # each layer's saved bytes, a sample
    assert ranks.boundary_bytes == 100 + 100 * 2  # layer 2's output at micro-batch 3, on its line
    looped, _, _ = pipeline_ranks(one, two, _records(), pp=2, v=2, micro=1)
    assert looped.stages == 2 and sum(len(f) for f in looped.forward) == 8
    assert pipeline_ranks(one, two, _records(), pp=4, v=2, micro=1) is None  # 8 chunks for 7 layers


def test_a_pipeline_step_is_its_slowest_ranks_micro_step_over_gas_plus_the_bubble():
    spec = parse_hardware(SPEC, "spec")
    matmul = lambda flops, block=None, phase="forward": OpRecord("aten.mm", flops, 0.0, phase, block)  # noqa: E731
    ranks = PipelineRanks(((matmul(1e12, 0),), (matmul(3e12, 1),)), (4_000_000, 2_000_000), (4, 2), 8e6, 0)
    backward = [matmul(8e12, phase="backward")]
    step = pipeline_step_prediction(ranks, backward, world_size=4, stages_per_rank=1, zero_stage=0,
                                    gradient_accumulation_steps=6, tokens_per_micro_step=4096, spec=spec,
                                    compute_efficiency=0.5)
    peak = 312e12 * 0.5
    slowest = 3e12 / peak + 8e12 * 3 / 4 / peak  # its forward and its share of the backward (3 of 4)
    other = 1e12 / peak + 8e12 / 4 / peak
    send = 5e-6 + 8e6 / 300e9  # stages 2 ranks apart, inside the node
    replicas = 2  # 4 ranks over 2 stages
    reduce = min(2 * (replicas - 1) * 5e-6 + 2 * 4 * 4e6 * 0.5 / 300e9, 2 * 1 * 5e-6 + 2 * 4 * 4e6 / 300e9)
    adam = 4e6 * ADAM_BYTES_PER_PARAMETER / 2.039e12
    # gas micro-steps at the slowest rank's pace, the fill and drain at the other's
    assert step.step_s == pytest.approx(6 * (slowest + 2 * send) + other + 2 * send + reduce + adam, rel=1e-9)
    interleaved = pipeline_step_prediction(ranks, backward, 4, 2, 0, 6, 4096, spec, 0.5)
    assert interleaved.step_s == pytest.approx(6 * (slowest + 4 * send) + other / 2 + 2 * send + reduce + adam,
                                               rel=1e-9)
    even = replace(ranks, forward=(ranks.forward[1], ranks.forward[1]))  # equal ranks: gas + (pp - 1) / v
    balanced = pipeline_step_prediction(even, backward, 4, 2, 0, 6, 4096, spec, 0.5)
    each = 3e12 / peak + 8e12 / 2 / peak
    assert balanced.step_s == pytest.approx((6 + 1 / 2) * (each + 4 * send) + reduce + adam, rel=1e-9)
    assert step.tokens_per_s_per_rank == pytest.approx(4096 * 6 / 2 / step.step_s)


def test_which_stage_counts_and_schedules_are_planned_and_what_is_not_costed_is_refused():
    census = _census(1)
    def config(stages, mapped=True, schedule="1F1B", per_rank=None, interval=0, zero=(0, 1), policy="none"):
        return SimpleNamespace(
            pipeline=SimpleNamespace(stages=stages, schedule=schedule, stages_per_rank=per_rank,
                                     activation_checkpoint_interval=interval),
            zero_optimization=SimpleNamespace(stages=zero), activation_checkpointing=SimpleNamespace(policy=policy),
            autotuning=SimpleNamespace(arg_mappings={"pipeline.stages": "--pp"} if mapped else {}))

    assert pipeline_degrees(config("auto"), 8, census, "ds.json") == (1, 2, 4)  # 8 stages would want 8 layers
    assert pipeline_degrees(config([2, 4]), 8, census, "ds.json") == (2, 4)
    assert pipeline_degrees(config("auto", mapped=False), 8, census, "ds.json") == (1,)  # the script's own
    refusals = {
        "pipeline.stages: 3 does not divide the 8 ranks": lambda: pipeline_degrees(config(3), 8, census, "ds.json"),
        "pipeline.stages 2: the script's PipelineModule built 1 stages": lambda: pipeline_degrees(
            config(2, mapped=False), 8, census, "ds.json"),
        "pipeline.stages: a list is searched only where": lambda: pipeline_degrees(config([1, 2], mapped=False), 8,
                                                                                census, "ds.json"),
        "pipeline.schedule 'ZBVZeroBubble': --hardware costs 1F1B, GPipe": lambda: pipeline_schedules(
            config(2, schedule="ZBVZeroBubble"), "ds.json"),
        "tensor_parallel.autotp_size: --hardware plans a pipeline's stages without": lambda: check_pipeline_costed(
            config(2), census, (1, 2), "train.py", "ds.json"),
        "pipeline.activation_checkpoint_interval 1: --hardware does not cost": lambda: check_pipeline_costed(
            config(2, interval=1), census, (1,), "train.py", "ds.json"),
        "zero_optimization.stage: the pipeline engine runs ZeRO 0 and 1 only": lambda: check_pipeline_costed(
            config(2, zero=(2, 3)), census, (1,), "train.py", "ds.json"),
        "activation_checkpointing.policy 'full': the pipeline engine takes no": lambda: check_pipeline_costed(
            config(2, policy="full"), census, (1,), "train.py", "ds.json"),
        "autotuning.arg_mappings.pipeline.stages: train.py built no PipelineModule": lambda: check_pipeline_costed(
            config(2), None, (1,), "train.py", "ds.json"),
    }
    for message, call in refusals.items():
        with pytest.raises(ConfigError, match=r"^ds\.json: " + message.replace("(", r"\(").replace(".", r"\.")):
            call()
    check_pipeline_costed(config("auto", mapped=False), None, (1, 2), "train.py", "ds.json")  # data parallel: planned
    check_pipeline_costed(config(2, zero=(0, 1, 2), policy="auto"), census, (1,), "train.py", "ds.json")  # as a tune
    assert pipeline_schedules(config(2, schedule="auto"), "ds.json") == (("1F1B", 1), ("Interleaved1F1B", 2))
    assert pipeline_schedules(config(2, schedule="LoopedBFS", per_rank=3), "ds.json") == (("LoopedBFS", 3),)
