"""A pipeline's memory, stage by stage: each stage's ranks hold that stage's parameters, gradients
and optimizer states (ZeRO 1 shards the states over the stage's replicas; tensor parallelism
inside the stage splits its split layers' share over the TP ranks) and the activations of the
micro-batches in flight on it (as measured at the layout, so already split where TP splits
them); the heaviest stage decides whether a layout fits.

In flight on stage s of p, with m micro-batches a step (gas): torch's 1F1B (Schedule1F1B) runs
min(p - s, m) forwards before the first backward there, and after it one forward per backward,
so stage 0 holds the most; GPipe runs all m forwards before any backward, on every stage, and so
does the engine for 1F1B with fewer micro-batches than stages (runtime/pipeline/schedules.py).
With v virtual stages per rank, each chunk forward holds 1/v of the rank's activations for a
micro-batch: torch's Interleaved1F1B runs (v - 1) r_m + 2 (p - 1 - s) chunk forwards before its
first backward (r_m the micro-batches of one of its rounds, max(1, m // p) rounds; at most v m)
and one more before each backward after; LoopedBFS runs all v m first. torch's
InterleavedZeroBubble splits each backward in two and keeps a chunk's graph until its weight
gradient, the second half: v min(m, p) chunk forwards await it at the peak, on every rank. There
are no DDP buckets (the engine averages each stage's gradients itself), and the gradients of
the step's micro-batches accumulate in place. Pure functions."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

SCHEDULES_IN_FLIGHT = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int, per_rank: int = 1) -> float:
    """Micro-batches' worth of activations stage `stage` holds at its peak (a fraction with
    virtual stages: chunk forwards over `per_rank`)."""
    m = max(1, micro_batches)
    name = schedule.lower()
    if name == "loopedbfs":
        return float(m)
    if name == "interleavedzerobubble" and per_rank > 1:
        return float(min(m, stages))
    if name == "interleaved1f1b" and per_rank > 1:
        rounds = max(1, m // stages)
        warmup = min((per_rank - 1) * (m // rounds) + 2 * (stages - 1 - stage), per_rank * m)
        chunk_forwards = warmup if warmup == per_rank * m else warmup + 1  # (the steady state's forward first)
        return chunk_forwards / per_rank
    if name == "gpipe" or m < stages:
        return float(m)
    return float(min(stages - stage, m))


def stage_estimates(profile, settings, micro_batch_size: int, estimate_one: Callable) -> list:
    """Each stage's MemoryEstimate (estimate.py) under `settings`, in stage order."""
    stages = len(profile.pipeline_stage_params)
    flat = replace(settings, contiguous_gradients=True, gradient_accumulation_steps=1)
    found = []
    split = profile.pipeline_stage_split_params or (0,) * stages
    for stage in range(stages):
        one = replace(profile, num_params=profile.pipeline_stage_params[stage],
                      activation_bytes_per_sample=profile.pipeline_stage_activation_bytes_per_sample[stage],
                      activation_bytes_per_sample_by_policy=(), pipeline_stage_params=(),
                      pipeline_stage_split_params=(), pipeline_stage_activation_bytes_per_sample=(),
                      split_num_params=split[stage], tensor_parallel=profile.tensor_parallel if split[stage] else 1,
                      peak_fits=())
        held = in_flight(profile.pipeline_schedule, stage, stages, settings.gradient_accumulation_steps,
                         profile.pipeline_stages_per_rank)
        found.append(estimate_one(one, flat, math.ceil(micro_batch_size * held)))
    return found
