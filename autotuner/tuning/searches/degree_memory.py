"""A tensor-parallel degree's profile launches held against what degree 1's profile and launches
predicted for them (tuning/memory/degree_prediction.py): the lines the summary gives, one per
launch. Each degree is still profiled at its own layout; these lines measure how far the
prediction from degree 1 alone would have taken it (issue 80, part 1)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from autotuner.tuning.memory.degree_prediction import profile_at_degree
from autotuner.tuning.models.memory_book import MemoryBook, MemoryFacts
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState

MIB = 2**20


def degree_memory_lines(layout: Layout, one: MemoryBook, one_layout: Layout, facts: MemoryFacts,
                        results: Sequence[TrialResult]) -> list[str]:
    """For each of `layout`'s measured launches in `results`: degree 1's analytic model moved to
    the degree, plus degree 1's fitted residual at the same stage and micro-batch, against the
    measured peak; first, the activation bytes per sample against those the degree's own profile
    measured (the activation model's error alone, before the peaks' noise). `one`: degree 1's memory book (its profile and launches); `facts`: the
    degree's own (its data-parallel size, budget, settings). Empty where nothing would split."""
    profile = profile_at_degree(one.profile, layout.tensor_parallel)
    if profile is None:
        return []
    moved = MemoryBook(dataclasses.replace(facts, profile=profile), lambda: ())
    own = facts.profile.activation_bytes_per_sample  # what the degree's own profile's probe measured
    lines = [f"{layout.text()}: activations predicted from {one_layout.text()}'s profile at "
             f"{profile.activation_bytes_per_sample / MIB:.3f} MiB per sample, measured by its own profile at "
             f"{own / MIB:.3f} ({100.0 * (profile.activation_bytes_per_sample - own) / max(1, own):+.1f}%)"]
    for result in results:
        measured = result.measured_memory_bytes
        if result.state is not TrialState.OK or not measured or result.experiment.layout != layout:
            continue
        experiment = result.experiment
        at_one = dataclasses.replace(experiment, tensor_parallel=one_layout.tensor_parallel,
                                     pipeline=one_layout.pipeline)
        predicted = moved.analytic_memory(experiment) + one.correction(at_one)
        error = 100.0 * (predicted - measured) / measured
        lines.append(f"{layout.text()}: {experiment.name} predicted from {one_layout.text()}'s profile and launches "
                     f"at {predicted / MIB:.0f} MiB, measured {measured / MIB:.0f} MiB ({error:+.1f}%)")
    return lines
