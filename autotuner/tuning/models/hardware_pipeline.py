"""A pipeline's training step on hardware that is not here, rank by rank, from the census of every
layer (runtime/pipeline/census.py), the roofline and the spec's links (issue 80, part 3).

As our pipeline engine runs it (torch's schedules, runtime/pipeline/schedules.py):

- a rank's micro-step is the forward and backward of the layers of its chunks (v a rank, placed
  looped: chunk c on rank c mod pp). The census times each layer's forward operators; the
  backward's operators carry no layer, so each rank's share of them is its share of the
  forward's time (a layer's backward costs in proportion to its forward: two matmuls per matmul);
- the slowest rank paces the pipeline: its gas micro-steps, each waiting on the activations sent
  to it and the gradients sent back (one send of the largest boundary each way a chunk, over the
  link between stages: a stage's replicas are neighbours, stages dp ranks apart, as DeepSpeed's
  PipeDataParallelTopology lays them out), plus the fill and drain, one micro-batch's forward and
  backward through every other rank, a v-th of it with v chunks a rank. With equal ranks that is
  cost_model.stage_steps' gas + (pp - 1) / v micro-steps; with one rank heavier (the head's
  stage), the bubble is paid at the lighter ranks' pace, not at the heaviest's;
- after the last backward, not overlapped (the engine averages each stage's gradients itself,
  no DDP buckets): a tied weight's gradients all-reduced over the stages holding it, each rank's
  gradients all-reduced in fp32 over its stage's dp replicas, ZeRO 1's broadcasts of the
  updated parameters, and the fp32 Adam step over the rank's share (hardware_step.py).
Pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotuner.config.hardware import HardwareSpec
from autotuner.runtime.measure.op_census import OpRecord
from autotuner.tuning.models.hardware_step import ADAM_BYTES_PER_PARAMETER, BF16, FP32, StepPrediction, rank_roofline
from autotuner.tuning.models.spec_collectives import collective_seconds, group_of


@dataclass(frozen=True)
class PipelineRanks:
    """What each pipeline rank runs and holds, in rank order: its layers' forward operators, its
    parameters (a tied module's on every rank that runs it) and their tensors; the largest
    activation one micro-batch sends across a stage boundary; the tied parameters two or more
    ranks hold."""

    forward: tuple[tuple[OpRecord, ...], ...]
    params: tuple[int, ...]
    parameter_tensors: tuple[int, ...]
    boundary_bytes: float
    tied_params: int = 0

    @property
    def stages(self) -> int:
        return len(self.params)


def pipeline_step_prediction(ranks: PipelineRanks, backward: Sequence[OpRecord], world_size: int, stages_per_rank: int,
                             zero_stage: int, gradient_accumulation_steps: int, tokens_per_micro_step: int,
                             spec: HardwareSpec, compute_efficiency: float, precision: str = "bf16",
                             ranks_per_node: int | None = None) -> StepPrediction:
    """One optimizer step of `gradient_accumulation_steps` micro-batches through `ranks.stages`
    pipeline ranks, `world_size / stages` replicas of the pipeline; `backward` the whole model's
    backward operators for one micro-batch (the census'), shared out by forward time."""
    pp, v = ranks.stages, max(1, stages_per_rank)
    dp = max(1, world_size // pp)
    share = spec.rank_share(ranks_per_node or min(world_size, spec.accelerators_per_node))
    roofline, whole = rank_roofline(spec, precision, compute_efficiency, share)
    forward = [roofline.total(records) for records in ranks.forward]
    backward_s = roofline.total(backward)
    total_forward = sum(forward) or 1.0
    compute = [f + backward_s * f / total_forward for f in forward]
    send = collective_seconds("send", ranks.boundary_bytes, group_of(2, dp, spec), spec) if pp > 1 else 0.0
    slowest = max(compute)
    gas = gradient_accumulation_steps
    # The slowest rank's gas micro-steps, each waiting on a send each way a chunk; and the fill and
    # drain around them, a micro-batch's pass through the other ranks (a v-th of it a chunk-step).
    micro_steps = gas * (slowest + 2 * v * send) + (sum(compute) - slowest) / v + 2 * (pp - 1) * send
    heaviest = max(range(pp), key=lambda r: ranks.params[r])
    held, tensors = ranks.params[heaviest], max(1, ranks.parameter_tensors[heaviest])
    replicas = group_of(dp, 1, spec)
    after = collective_seconds("all_reduce", FP32 * held, replicas, spec)
    if pp > 1 and ranks.tied_params:
        after += collective_seconds("all_reduce", FP32 * ranks.tied_params, group_of(2, dp * (pp - 1), spec), spec)
    if zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts each updated fp32 parameter from its owner
        after += tensors * collective_seconds("broadcast", FP32 * held / tensors, replicas, spec)
    local = held / dp if zero_stage >= 1 else held
    adam = ADAM_BYTES_PER_PARAMETER - (BF16 if precision == "fp32" else 0)
    optimizer = local * adam / (spec.memory_bandwidth * share)
    step = (micro_steps + after + optimizer) * whole
    tokens = tokens_per_micro_step * gas / pp  # a replica's micro-batches pass through its pp ranks
    model_flops = (sum(r.flops for records in ranks.forward for r in records) + sum(r.flops for r in backward)) * gas / pp
    return StepPrediction(step, max(compute) * whole, (2 * v * send + after / gas) * whole, optimizer * whole,
                          tokens / step, model_flops / (step * roofline.peak_flops))
