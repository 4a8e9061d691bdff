"""A data-parallel training step's time on hardware that is not here, from one micro-step's
operator census (runtime/measure/op_census.py), the roofline (roofline.py) and the spec's links
(spec_collectives.py) (issue 80, part 3).

Per micro-step, by ZeRO stage, on our engine's layouts and torchtitan's FSDP2 defaults (bf16
compute copies, fp32 gradient reduction, parameters resharded after the forward):

- ZeRO 3 (FSDP2): the parameters all-gathered in bf16 for the forward and again for the backward,
  the gradients reduce-scattered in fp32, every micro-step;
- ZeRO 2: the all-gather once a step, the reduce-scatter every micro-step;
- ZeRO 0 and 1 (DDP): the gradients all-reduced in fp32 once a step, over the last backward; ZeRO 1
  then all-gathers the updated parameters in bf16 after the optimizer step.
The collectives of a micro-step overlap its compute (FSDP2 prefetches the next unit's gather
while this one computes; DDP's buckets reduce during the backward): a micro-step takes the longer
of the two. What is not overlapped: ZeRO 1's gather after the step, and the optimizer step, an
fp32 Adam over the rank's share of the parameters, costed by its bytes (each element's parameter,
gradient and two moments read, three written, and its bf16 copy) at the memory bandwidth.
Pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotuner.config.hardware import HardwareSpec
from autotuner.runtime.measure.op_census import OpRecord
from autotuner.tuning.models.roofline import Roofline, step_compute_seconds
from autotuner.tuning.models.spec_collectives import collective_seconds, group_of

BF16, FP32 = 2, 4
ADAM_BYTES_PER_PARAMETER = 4 * FP32 + 3 * FP32 + BF16  # read param, grad, m, v; write param, m, v; the bf16 copy


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float  # one micro-step's forward, backward and recompute
    communication_s: float  # one micro-step's collectives (ZeRO 3; the step's for ZeRO 0-2, spread)
    optimizer_s: float
    tokens_per_s_per_rank: float
    model_flops_utilization: float  # the census' FLOPs without recompute, over the step and the peak


@dataclass(frozen=True)
class TensorParallel:
    """A degree k and what its plan splits, counted at degree 1 (runtime/measure/profile.py
    SplitRegions): the split Linears' parameters (whole), the share of the forward's FLOPs in the
    split regions, and the row-wise layers with their outputs' bytes on one micro-batch."""

    degree: int = 1
    split_params: int = 0
    flop_share: float = 0.0
    row_layers: int = 0
    row_output_bytes: float = 0.0  # all the row-wise layers' outputs together
    col_layers: int = 0  # column-wise layers; 0 where not counted (then one a row-wise layer)

    @property
    def all_reduces(self) -> int:
        """A micro-step's all-reduces at degree k, as the engine splits a plan (torch's
        ColwiseParallel and RowwiseParallel a Linear): a row-wise layer's output in the forward,
        a column-wise layer's input gradient in the backward."""
        return self.row_layers + (self.col_layers or self.row_layers)

    def params_per_rank(self, num_params: int) -> int:
        return num_params - self.split_params + -(-self.split_params // max(1, self.degree))


def step_prediction(records: Sequence[OpRecord], num_params: int, world_size: int, zero_stage: int,
                    gradient_accumulation_steps: int, tokens_per_micro_step: int, policy: str,
                    spec: HardwareSpec, compute_efficiency: float,
                    tensor_parallel: TensorParallel = TensorParallel()) -> StepPrediction:
    """One optimizer step of `gradient_accumulation_steps` micro-steps, each the census' `records`
    (one rank's micro-batch of `tokens_per_micro_step` tokens), over `world_size` ranks: data
    parallel over world / k of them, each model split over k neighbours by `tensor_parallel`.
    At degree k a rank runs the split regions' share of each operator's cost over k and the rest
    whole (the census' operators scaled by 1 - s + s / k: a matmul's backward costs in proportion
    to its forward), and waits each micro-step on an all-reduce of the hidden states a split layer
    (a row-wise layer's output in the forward, a column-wise layer's input gradient in the
    backward) over the node's link, on the critical path."""
    roofline = Roofline(spec.peak_bf16_flops, spec.memory_bandwidth, compute_efficiency)
    tp = tensor_parallel
    k = max(1, tp.degree)
    compute = step_compute_seconds(records, policy, roofline) * (1 - tp.flop_share + tp.flop_share / k)
    if k > 1 and tp.row_layers:
        each = collective_seconds("all_reduce", tp.row_output_bytes / tp.row_layers, group_of(k, 1, spec), spec)
        compute += tp.all_reduces * each
    num_params = tp.params_per_rank(num_params)
    world_size = max(1, world_size // k)
    group = group_of(world_size, k, spec)
    gas = gradient_accumulation_steps
    gather = collective_seconds("all_gather", BF16 * num_params, group, spec)
    scatter = collective_seconds("reduce_scatter", FP32 * num_params, group, spec)
    if zero_stage >= 3:
        per_micro = 2 * gather + scatter
        micro_steps = gas * max(compute, per_micro)
        communication, after = per_micro, 0.0
    elif zero_stage == 2:
        per_step = gather + gas * scatter
        micro_steps = max(gas * compute, per_step)
        communication, after = per_step / gas, 0.0
    else:
        reduce = collective_seconds("all_reduce", FP32 * num_params, group, spec)
        micro_steps = (gas - 1) * compute + max(compute, reduce)
        communication, after = reduce / gas, (gather if zero_stage == 1 else 0.0)
    local = num_params / world_size if zero_stage >= 1 else num_params
    optimizer = local * ADAM_BYTES_PER_PARAMETER / spec.memory_bandwidth
    step = micro_steps + after + optimizer
    tokens = tokens_per_micro_step * gas / k  # a replica's micro-batch is shared by its k ranks
    model_flops = sum(r.flops for r in records) * gas / k
    return StepPrediction(step, compute, communication, optimizer, tokens / step,
                          model_flops / (step * spec.peak_bf16_flops))
