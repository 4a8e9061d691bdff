"""Memory when batches vary in length (dynamic padding): the peak planned at the longest batch.

A launch's window records, per rank and optimizer step, the step's longest input (dim 1 of the
model's first tensor input) and the memory peak so far (`Measurement.step_peaks`: the allocator's
on a GPU, the resident set's mark on a CPU). The peak so far rises only at a step whose batch is
longer than every one before it on that rank: those record steps are (length, peak) points of
this micro-batch, and a line through them is the memory per position. (Each step's own peak would
not do better on a CPU: glibc keeps what a longer batch freed, so a shorter one shows it too.) A pick sized on the profile's batches alone runs out of memory hours later, at the
longest batch (torchtune #2830), so every launch is judged at the length the run will reach:
the script's declared maximum (`--max_seq_length` and the like, or autotuning.max_sequence_length),
else the longest seen plus the spread of the lengths seen, and the summary says which. Pure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from autotuner.core.boundary import Measurement
from autotuner.launch.script_args import find_flag

# The script flags that declare the longest sequence a batch can hold, as Hugging Face's example
# scripts name them (run_clm: --block_size; run_glue/run_ner/run_qa: --max_seq_length; run_summarization:
# --max_source_length; many others: --max_length).
MAX_LENGTH_FLAGS = ("--max_seq_length", "--max_length", "--block_size", "--max_source_length", "--seq_len")
SPREAD_NOTE = "the longest seen plus the spread of the lengths seen"


@dataclass(frozen=True)
class LongestBatch:
    """One launch's memory at the run's longest batch."""

    seen_min: int
    seen_max: int
    planned_length: int
    peak_seen_bytes: int
    planned_peak_bytes: int
    bytes_per_position: float
    fitted: bool  # from two or more record steps; else scaled in proportion (an upper bound)


def longest_batch(measurement: Measurement, max_length: int | None) -> LongestBatch | None:
    """The launch's peak at the planned longest batch; None when its window's lengths never varied."""
    lengths = [length for rank in measurement.step_peaks for length, _ in rank if length > 0]
    if len(set(lengths)) < 2:
        return None
    seen_max = max(lengths)
    planned = max_length or seen_max + math.ceil(statistics.pstdev(lengths))
    peak_seen = int(measurement.peak_memory_bytes or max(p for rank in measurement.step_peaks for _, p in rank))
    records = [point for rank in measurement.step_peaks for point in _records(rank)]
    slope = _slope(records)
    fitted = slope is not None
    at_peak = max(records, key=lambda point: point[1])[0] if records else seen_max
    if slope is None or slope <= 0:
        # Too few record steps to fit (or noise over the signal): every byte above what the rank held
        # as its first forward began, in proportion to the length. Optimizer states are in that share
        # and do not grow, so this errs long (short only for a script that holds length-sized
        # buffers before its first forward).
        fitted = False
        before = measurement.bytes_before_first_step or 0
        slope = max(0, peak_seen - before) / max(1, at_peak)
    extra = max(0.0, slope) * max(0, planned - at_peak)
    return LongestBatch(min(lengths), seen_max, planned, peak_seen, int(peak_seen + extra), slope, fitted)


def _records(rank: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The steps that set a new longest batch and raised the peak: the peak then is that step's own.
    The first step (step 1, its optimizer states allocated) is only the baseline to raise."""
    points: list[tuple[int, int]] = []
    if not rank:
        return points
    longest, previous = rank[0]
    for length, peak in rank[1:]:
        if length > longest and peak > previous:
            points.append((length, peak))
        longest, previous = max(longest, length), max(previous, peak)
    return points


def _slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares bytes per position through the record steps; None with fewer than two lengths."""
    if len({length for length, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    variance = sum((x - mean_x) ** 2 for x, _ in points)
    return covariance / variance


def declared_max_length(script_args: tuple[str, ...], configured: int | None) -> tuple[int | None, str]:
    """(the longest sequence the run can see, where that was read), or (None, "") when undeclared."""
    if configured:
        return configured, "autotuning.max_sequence_length"
    for flag in MAX_LENGTH_FLAGS:
        found = find_flag(tuple(script_args), flag)
        if found and found[1] is not None and found[1].isdigit() and int(found[1]) > 0:
            return int(found[1]), f"the script's {flag}"
    return None, ""


def varying_batch_lines(measurements: list[Measurement], max_length: int | None, source: str) -> list[str]:
    """The summary's line when the launches saw batches of varying length."""
    found = [b for m in measurements if (b := longest_batch(m, max_length)) is not None]
    if not found:
        return []
    low, high = min(b.seen_min for b in found), max(b.seen_max for b in found)
    planned = max(b.planned_length for b in found)
    why = source if max_length else SPREAD_NOTE + " (no maximum declared: pass --max_seq_length or set " \
                                                  "autotuning.max_sequence_length to plan for the true one)"
    rise = max(100.0 * (b.planned_peak_bytes - b.peak_seen_bytes) / b.peak_seen_bytes for b in found)
    return [f"Batches vary in length: the launches saw {low} to {high} positions per sample; every launch's "
            f"memory was judged at {planned} ({why}), up to {rise:.0f}% above its measured peak."]
