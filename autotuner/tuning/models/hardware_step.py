"""A data-parallel training step's time on hardware that is not here, from one micro-step's
operator census (runtime/measure/op_census.py), the roofline (roofline.py) and the spec's links
(spec_collectives.py) (issue 80, part 3).

Per optimizer step of gas micro-steps, by ZeRO stage, as our engine runs them (compute copies in
the run's precision, fp32 gradient reduction):

- ZeRO 3 (FSDP2): the parameters all-gathered for each forward and again for each backward
  (resharded after both), the gradients reduce-scattered in fp32 once, in the last backward
  (unsharded between micro-steps);
- ZeRO 2: gathered for each forward (resharded after the backward), reduce-scattered once;
- ZeRO 0 and 1 (DDP): the gradients all-reduced in fp32 once, over the last backward; ZeRO 1
  then broadcasts each updated fp32 parameter from the rank that owns it.
At gas 1 this is torchtitan's FSDP2 default too. FSDP2 runs each collective unit by unit (the
blocks and the root). With `overlap_communication` (GPU) a micro-step takes the longer of its
compute and its collectives (FSDP2 prefetches the next unit's gather; DDP's buckets reduce during
the backward); without (a CPU, where gloo's threads share the cores), their sum. Not overlapped:
ZeRO 1's broadcasts, and the optimizer step, an fp32 Adam over the rank's share of the
parameters, costed by its bytes (each element's parameter, gradient and two moments read, three
written, and its low-precision copy) at the memory bandwidth.
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


def rank_roofline(spec: HardwareSpec, precision: str, compute_efficiency: float, share: float
                  ) -> tuple[Roofline, float]:
    """A rank's roofline at its `share` of a node (spec.rank_share), and the factor on the whole step.
    On a GPU the efficiency is the share of the peak the matmuls reach (the factor 1). On a CPU
    every part of a step (operators, gloo's collectives, the optimizer) runs on the same cores,
    measured apart on an idle machine (host_spec.py): the efficiency is the share of that speed a
    rank keeps in training, and scales the whole step."""
    whole = 1.0 / compute_efficiency if spec.device == "cpu" else 1.0
    matmul = 1.0 if spec.device == "cpu" else compute_efficiency
    peak = spec.peak_flops(precision) * share
    return Roofline(peak, spec.memory_bandwidth * share, matmul, spec.op_overhead_s / share), whole


def step_prediction(records: Sequence[OpRecord], num_params: int, world_size: int, zero_stage: int,
                    gradient_accumulation_steps: int, tokens_per_micro_step: int, policy: str,
                    spec: HardwareSpec, compute_efficiency: float,
                    tensor_parallel: TensorParallel = TensorParallel(), precision: str = "bf16",
                    ranks_per_node: int | None = None, fsdp_units: int = 1,
                    parameter_tensors: int = 1) -> StepPrediction:
    """One optimizer step of `gradient_accumulation_steps` micro-steps, each the census' `records`
    (one rank's micro-batch of `tokens_per_micro_step` tokens), over `world_size` ranks: data
    parallel over world / k of them, each model split over k neighbours by `tensor_parallel`.
    At degree k a rank runs the split regions' share of each operator's cost over k and the rest
    whole (the census' operators scaled by 1 - s + s / k: a matmul's backward costs in proportion
    to its forward), and waits each micro-step on an all-reduce of the hidden states a split layer
    (a row-wise layer's output in the forward, a column-wise layer's input gradient in the
    backward) over the node's link, on the critical path.
    `precision` is the compute copies' ("bf16", "fp16" or "fp32": the peak and the bytes gathered);
    `ranks_per_node` (default the world, at most a node) is how many ranks share a CPU node's cores
    (spec.rank_share), each then computing at its share of the peak and the bandwidth;
    `fsdp_units` the modules FSDP2 shards one by one (the blocks and the root), each collective
    paying its latency once a unit; `parameter_tensors` the
    model's parameters, which ZeRO 1 broadcasts one by one after the step."""
    share = spec.rank_share(ranks_per_node or min(world_size, spec.accelerators_per_node))
    roofline, whole = rank_roofline(spec, precision, compute_efficiency, share)
    peak = roofline.peak_flops
    copy = FP32 if precision == "fp32" else BF16
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
    units = max(1, fsdp_units)
    both = max if spec.overlap_communication else (lambda a, b: a + b)  # gloo shares the cores: no overlap

    def by_unit(op: str, nbytes: float) -> float:  # FSDP2 runs each collective unit by unit
        return units * collective_seconds(op, nbytes / units, group, spec)

    if zero_stage >= 2:
        # Our engine: gradients synced at the step's last micro-step only (unsharded between);
        # parameters resharded after every backward, so gathered for each forward, and (ZeRO 3,
        # resharded after the forward too) again for each backward.
        gathers = 2 if zero_stage >= 3 else 1
        per_micro = gathers * by_unit("all_gather", copy * num_params)
        scatter = by_unit("reduce_scatter", FP32 * num_params)
        micro_steps = (gas - 1) * both(compute, per_micro) + both(compute, per_micro + scatter)
        communication, after = per_micro + scatter / gas, 0.0
    else:
        reduce = collective_seconds("all_reduce", FP32 * num_params, group, spec)
        micro_steps = (gas - 1) * compute + both(compute, reduce)
        after = 0.0
        if zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts each updated fp32 parameter from its owner
            each = collective_seconds("broadcast", FP32 * num_params / max(1, parameter_tensors), group, spec)
            after = max(1, parameter_tensors) * each
        communication = reduce / gas
    local = num_params / world_size if zero_stage >= 1 else num_params
    adam = ADAM_BYTES_PER_PARAMETER - (BF16 if precision == "fp32" else 0)  # no low-precision copy to write
    optimizer = local * adam / (spec.memory_bandwidth * share)
    step = (micro_steps + after + optimizer) * whole
    compute, communication, optimizer = compute * whole, communication * whole, optimizer * whole
    tokens = tokens_per_micro_step * gas / k  # a replica's micro-batch is shared by its k ranks
    model_flops = sum(r.flops for r in records) * gas / k
    return StepPrediction(step, compute, communication, optimizer, tokens / step,
                          model_flops / (step * peak))
