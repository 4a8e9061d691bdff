"""Memory model for DeepSpeed's own ZeRO engine: bytes per rank for a stage, precision and
its zero_optimization knobs. Pure functions; the tuner's residual fit (peak_fit.py)
calibrates them against the peaks each launch measures.

What DeepSpeed 0.19 holds, per rank, for P parameters over N data-parallel ranks, with c the
compute bytes (2 for fp16/bf16, 4 for fp32) and Adam's states s bytes per parameter:
- stage 0: the model's parameters and gradients (c each); with bf16/fp16 an fp32 master copy
  and fp32 gradient accumulators besides (BF16_Optimizer / FP16_Optimizer); the optimizer
  states whole; gradients are all-reduced through a flat buffer of up to 5e8 elements.
- stage 1/2 (DeepSpeedZeroOptimizer): the parameters flattened in the compute dtype (c·P),
  plus an fp32 master copy of this rank's partition (4·P/N, cloned even in fp32), its
  optimizer states (s·P/N) and the partition's fp32 gradient at the step (4·P/N). Stage 1
  keeps whole gradients until the boundary (c·P); stage 2 reduces them into
  `reduce_bucket_size`-element buckets (two with `overlap_comm`) and keeps its partition
  (c·P/N, the contiguous buffer under `contiguous_gradients`).
- stage 3 (DeepSpeedZeroOptimizer_Stage3): parameter partitions (c·P/N) and the parameters
  gathered for the running and prefetched modules (up to `stage3_prefetch_bucket_size`, and
  never more than `stage3_max_live_parameters`), the fp32 master partition, its states and
  gradients, and a `reduce_bucket_size` bucket.
- `offload_optimizer` (stage 1-3) moves the master copy, the states and the fp32 gradients to
  the host; `offload_param` (stage 3) the parameter partitions too.
Defaults are DeepSpeed's: buckets of 5e8 elements, prefetch 5e7, max live 1e9, overlap_comm
on at stage 3 only, contiguous_gradients on.
"""

from __future__ import annotations

from typing import Any

BYTES_FP32 = 4
STAGE0_ALLREDUCE_ELEMENTS = 500_000_000  # DeepSpeed's stage-0 all-reduce buffer (MEMORY_OPT_ALLREDUCE_SIZE)
DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "contiguous_gradients": True,
}


def zero_knob(knobs: dict[str, Any], name: str, stage: int) -> Any:
    """The knob's value as DeepSpeed would take it: the config's, else DeepSpeed's default.

    "auto" is costed at the default too: DeepSpeed drops an "auto" nobody filled in, and what
    Hugging Face's Trainer fills in (hidden_size**2 for buckets, 0.9 * hidden_size**2 for the
    stage-3 prefetch) is no larger for hidden sizes up to 7,450, so the estimate errs high; the
    fit to measured peaks corrects the rest (these buffers do not grow with the micro-batch)."""
    value = knobs.get(name)
    if value == "auto":
        value = None
    if name == "overlap_comm" and value is None:
        return stage == 3
    return DEFAULTS.get(name) if value is None else value


def deepspeed_state_bytes(num_params: int, optimizer_state_bytes_per_param: float, stage: int, compute_bytes: int,
                          world_size: int, knobs: dict[str, Any], offload_optimizer: bool = False,
                          offload_param: bool = False) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer states, working buffers) in bytes on one rank."""
    p, n, c = num_params, max(1, world_size), compute_bytes
    optimizer = int(optimizer_state_bytes_per_param * p)
    low_precision = c < BYTES_FP32
    if stage == 0:
        parameters, gradients = c * p, c * p
        buffers = c * min(p, STAGE0_ALLREDUCE_ELEMENTS)
        if low_precision:
            parameters += BYTES_FP32 * p  # fp32 master weights
            gradients += BYTES_FP32 * p  # fp32 gradient accumulators
        return parameters, gradients, optimizer, buffers
    reduce_bucket = int(zero_knob(knobs, "reduce_bucket_size", stage))
    buckets = 2 if zero_knob(knobs, "overlap_comm", stage) else 1
    master = BYTES_FP32 * p // n  # cloned fp32 partition, even when the model is fp32
    states = optimizer // n
    fp32_gradients = BYTES_FP32 * p // n
    if offload_optimizer:
        master = states = fp32_gradients = 0
    if stage in (1, 2):
        parameters = c * p + master
        gradients = (c * p if stage == 1 else c * p // n) + fp32_gradients
        buffers = buckets * c * min(p, reduce_bucket) if stage == 2 else c * min(p, reduce_bucket)
        return parameters, gradients, states, buffers
    prefetch = int(zero_knob(knobs, "stage3_prefetch_bucket_size", stage))
    live = int(zero_knob(knobs, "stage3_max_live_parameters", stage))
    partitions = 0 if offload_param else c * p // n
    gathered = c * min(p, prefetch, live)
    gradients = c * p // n + (fp32_gradients if low_precision else 0)
    buffers = gathered + c * min(p, reduce_bucket)
    return partitions + master, gradients, states, buffers
