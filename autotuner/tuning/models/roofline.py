"""A step's operators costed against an accelerator's datasheet: the roofline (issue 80, part 3).

Each operator (runtime/measure/op_census.py) takes the longer of its FLOPs at the accelerator's
peak times a compute efficiency, and its bytes at the memory bandwidth:

    t(op) = overhead + max(flops / (peak x efficiency), bytes / bandwidth)

The efficiency is the one constant a plan fits (on one measured or published step), stated beside
every figure it yields; the bandwidth is the datasheet's, unscaled. The overhead is the spec's
op_overhead_s (0 unless stated: on a GPU the launches overlap the kernels; on a CPU each eager
operator pays its dispatch). Activation checkpointing adds the forward operators it recomputes
in the backward, by policy:

- "none": nothing; "full": every block's forward;
- "selective_layer" (torchtitan's layer policy at frequency 2): every second block's forward;
- "selective_op" (torchtitan's op policy): each block's forward but its attention and every other
  matmul (their outputs are kept);
- "selective" (ours, activation_checkpointing.policy): each block's forward but its matmuls and
  attention.
Pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from autotuner.runtime.measure.op_census import OpRecord

POLICIES = ("none", "full", "selective_layer", "selective_op", "selective")
LAYER_FREQUENCY = 2  # torchtitan's selective layer checkpointing: every second block


@dataclass(frozen=True)
class Roofline:
    peak_flops: float  # FLOP/s (the datasheet's dense bf16 peak)
    memory_bandwidth: float  # bytes/s
    compute_efficiency: float = 1.0  # the fitted share of the peak a matmul reaches
    op_overhead_s: float = 0.0  # each operator's fixed cost: dispatch, autograd, a kernel's launch

    def seconds(self, record: OpRecord) -> float:
        return self.op_overhead_s + max(record.flops / (self.peak_flops * self.compute_efficiency),
                                        record.bytes / self.memory_bandwidth)

    def total(self, records: Iterable[OpRecord]) -> float:
        return sum(self.seconds(r) for r in records)


def recomputed(records: Sequence[OpRecord], policy: str) -> list[OpRecord]:
    """The forward operators `policy` runs again in the backward."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy {policy!r}: expected one of {', '.join(POLICIES)}")
    in_blocks = [r for r in records if r.phase == "forward" and r.block is not None]
    if policy == "none":
        return []
    if policy == "full":
        return in_blocks
    if policy == "selective_layer":
        return [r for r in in_blocks if r.block % LAYER_FREQUENCY == LAYER_FREQUENCY - 1]
    if policy == "selective":
        return [r for r in in_blocks if not (r.is_matmul or r.is_attention)]
    again, matmuls = [], {}
    for r in in_blocks:  # "selective_op": attention kept, every second matmul of a block recomputed
        if r.is_attention:
            continue
        if r.is_matmul:
            matmuls[r.block] = matmuls.get(r.block, 0) + 1
            if matmuls[r.block] % 2:
                continue
        again.append(r)
    return again


def step_compute_seconds(records: Sequence[OpRecord], policy: str, roofline: Roofline) -> float:
    """One micro-step's forward, backward and recompute on the accelerator."""
    return roofline.total(records) + roofline.total(recomputed(records, policy))
