"""A tensor-parallel degree's profile launches held against the step time degree 1's launches
predicted for them (tuning/models/degree_time.py): the lines the summary gives, one per launch
the model covers (ZeRO 0). As with memory (degree_memory.py), each degree is still profiled at
its own layout; these lines say how far the prediction from degree 1 alone would have taken it."""

from __future__ import annotations

from typing import Sequence

from autotuner.tuning.models.degree_time import degree_time_model
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState


def degree_time_lines(layout: Layout, one_layout: Layout, results_at_one: Sequence[TrialResult],
                      params_per_rank: int, results: Sequence[TrialResult], world_size: int) -> list[str]:
    """For each of `layout`'s measured ZeRO 0 launches in `results`, in order: the step time
    predicted from `results_at_one` (degree 1's), its parts, against the measured. The first is
    degree 1's prediction alone, its check; each later one adds what the degree's launches before
    it measured beyond their predictions, per micro-step (the prediction refitted: what degree 1
    cannot see, such as DTensor's dispatch per op). Empty where degree 1 cannot predict it."""
    model = degree_time_model(results_at_one, world_size)
    if model is None:
        return []
    lines: list[str] = []
    excess: list[float] = []  # the degree's launches so far: measured - predicted, per micro-step
    for result in results:
        m = result.measurement
        if result.state is not TrialState.OK or m is None or not m.latency or result.experiment.layout != layout:
            continue
        step = model.predict(result.experiment, params_per_rank)
        if step is None:
            continue
        gas = result.experiment.gradient_accumulation_steps
        refit = sum(excess) / len(excess) if excess else 0.0
        predicted = step.total_s + gas * refit
        error = 100.0 * (predicted - m.latency) / m.latency
        source = (f"{one_layout.text()}'s launches" if not excess else
                  f"{one_layout.text()}'s launches and its own {len(excess)} before ({1e3 * refit:+.1f} ms a micro-step)")
        lines.append(f"{layout.text()}: {result.name} step predicted from {source} at {1e3 * predicted:.1f} ms "
                     f"(forward and backward {1e3 * step.compute_s:.1f}, split layers' dispatch and all-reduces "
                     f"{1e3 * step.tensor_parallel_s:.1f}, optimizer step and the rest {1e3 * step.other_s:.1f}), "
                     f"measured {1e3 * m.latency:.1f} ms ({error:+.1f}%)")
        excess.append((m.latency - step.total_s) / gas)
    return lines
