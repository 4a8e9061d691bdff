"""Whether a tensor-parallel degree is worth its profile, from degree 1's launches alone (issue 80, part 1).

Degree 1's launches give each micro-step's forward and backward time F(m) = a + b m (a line through
the fastest launch at each micro-batch m, models/degree_time.py `micro_step_line`). At degree k a
rank runs the split regions' work divided by k and the rest whole, pays the fixed cost a per
micro-step as before (the same ops, each smaller), and pays for each split layer at least the
least the profile's probe timed it adding at a small size on the degree's groups (DTensor's
dispatch and the layer's one all-reduce there, on the critical path since the next layer needs
the sum: runtime/measure/split_layer_probe.py, its floor; C column-wise and R row-wise layers a
micro-step). So at
micro-batch m' a micro-step costs at least

    F_k(m') = a + (s / k + 1 - s) b m' + C d_col + R d_row

(from a profile without the split layers timed: 2 R x the fastest all_reduce the probe timed on
such groups)

and the job's samples/s is at most dp_k m' / F_k(m'), largest at the largest micro-batch the
degree's space allows, with dp_k = the ranks / k. s is the share of the forward's FLOPs inside the
split regions (the profile's probe, runtime/measure/profile.py; a matmul's backward costs twice its
forward, so the share holds for the backward too). Everything else is left out, in the degree's
favour: the all-reduces' bytes past the probe's size, the optimizer step, the data-parallel reduction, memory (the largest
micro-batch is taken to fit). A degree whose bound is below degree 1's best measured samples/s,
beyond the noise floor, cannot win, and its profile is not launched.

F counts, per launch, the smaller of forward + backward and three times the forward: a backward
at ZeRO 0-2 may hold the data-parallel reduction (more than degree k's), a forward does not, and
its backward costs twice its FLOPs; ZeRO 3's forward gathers, so its launches count their sum.
What the bound assumes, and the summary says: time follows FLOPs inside and outside the split
regions alike, and a split matmul is no faster per FLOP than the whole one. Throughput
objectives only; elsewhere every degree is profiled. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotuner.tuning.models.cost_model import NOISE_FLOOR
from autotuner.tuning.models.degree_time import all_reduce_floor_s, micro_step_line, split_costs
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchSpace

__all__ = ["DegreeBound", "bound_before_profile", "bound_verdict", "degree_bound", "micro_step_line"]


@dataclass(frozen=True)
class DegreeBound:
    """The most samples/s `degree` could reach, against degree 1's best measured."""

    degree: int
    split_flop_share: float
    fixed_s: float  # degree 1's forward + backward per micro-step: fixed_s + per_sample_s x micro-batch
    per_sample_s: float
    micro_batch_size: int  # the degree's largest, where its bound is highest
    split_layers_s: float  # what a micro-step's split layers add, as probed
    bound_samples_per_s: float
    best_samples_per_s: float
    best_name: str

    @property
    def cannot_win(self) -> bool:
        return self.bound_samples_per_s * (1 + NOISE_FLOOR) < self.best_samples_per_s

    def line(self, layout: Layout, one: Layout, skipped: bool = True) -> str:
        """The summary's line; `skipped` false where the tune profiles a degree that cannot win all the
        same (autotuning.bound_layouts false)."""
        verdict = ("profiled (it may win" if not self.cannot_win else "not profiled (cannot win" if skipped
                   else "profiled all the same, autotuning.bound_layouts false (cannot win")
        return (f"{verdict}: at most {self.bound_samples_per_s:.4g} samples/s from {one.text()}'s launches "
                f"at micro-batch {self.micro_batch_size} ({100 * self.split_flop_share:.1f}% of the forward's FLOPs "
                f"split {self.degree} ways, forward and backward {1e3 * self.fixed_s:.3g} ms a micro-step + "
                f"{1e3 * self.per_sample_s:.3g} ms a sample, its split layers' dispatch and all-reduces "
                f"{1e3 * self.split_layers_s:.3g} ms a micro-step at the probe's floor; its optimizer step left out), "
                f"against {self.best_samples_per_s:.4g} measured at {self.best_name})")


def degree_bound(degree: int, split_flop_share: float, data_parallel_size: int, largest_micro_batch: int,
                 results_at_one: Sequence[TrialResult], split_layers_s: float = 0.0) -> DegreeBound | None:
    """`degree`'s bound at its data-parallel size and largest micro-batch, from degree 1's launches
    (their measured samples/s, one-off costs aside) and `split_layers_s`, what a micro-step's split
    layers add as the probe timed them on the degree's groups; None where they cannot give one: no split
    share measured, under two micro-batch sizes timed, nothing measured."""
    if degree <= 1 or not 0 < split_flop_share <= 1 or largest_micro_batch < 1:
        return None
    line = micro_step_line(results_at_one)
    measured = [r for r in results_at_one if r.state is TrialState.OK and r.measurement is not None
                and r.measurement.throughput > 0]
    if line is None or not measured:
        return None
    fixed, per_sample = line
    best = max(measured, key=lambda r: r.measurement.throughput)
    m = largest_micro_batch
    micro_step = fixed + (split_flop_share / degree + 1 - split_flop_share) * per_sample * m + split_layers_s
    return DegreeBound(degree, split_flop_share, fixed, per_sample, m, split_layers_s,
                       data_parallel_size * m / micro_step,
                       float(best.measurement.throughput), best.name)


def bound_before_profile(degree: int, results_at_one: Sequence[TrialResult], space: SearchSpace,
                         world_size: int) -> DegreeBound | None:
    """`degree`'s bound from degree 1's results (its profile's model info among them: the split
    share, the row-wise layers, the probe's timings) at `space`, the degree's search space."""
    infos = [r.model_info for r in results_at_one if r.model_info is not None and r.model_info.split_flop_share > 0]
    if not infos:
        return None
    info = infos[0]
    costs = split_costs(info.split_layer_timings).get(degree)
    if costs is not None:
        split_layers = costs.floor_per_micro_step(info.split_col_layers, info.split_row_layers)
    else:
        timings = [t for one in infos for t in one.collective_timings]
        split_layers = 2 * info.split_row_layers * all_reduce_floor_s(timings, degree, world_size)
    sizes = space.valid_micro_batch_sizes(space.max_micro_batch_size)
    return degree_bound(degree, info.split_flop_share, space.data_parallel_size, max(sizes, default=0),
                        results_at_one, split_layers)


def bound_verdict(layout: Layout, one: Layout, results_at_one: Sequence[TrialResult], space: SearchSpace,
                  world_size: int, metric: str, bound_layouts: bool) -> tuple[bool, str] | None:
    """Before `layout`'s profile: (whether to skip it: it cannot win and `bound_layouts` lets the
    bound decide, the summary's line), from `one`'s (degree 1's) results at `space`, the degree's
    search space; None where they cannot say (another metric, no split measured, fewer than two
    micro-batch sizes timed)."""
    if layout.tensor_parallel <= 1 or metric != "throughput":
        return None
    bound = bound_before_profile(layout.tensor_parallel, results_at_one, space, world_size)
    if bound is None:
        return None
    skip = bound.cannot_win and bound_layouts
    return skip, f"layout: {layout.text()} x data parallel {space.data_parallel_size}: {bound.line(layout, one, skip)}"
