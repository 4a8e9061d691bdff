"""A tensor-parallel degree's step time predicted from degree 1's launches (issue 80, part 1).

Degree 1's ZeRO 0 launches give a micro-step's forward + backward F(m) = a + b m (the fastest
launch at each micro-batch, `micro_step_line`), the optimizer step, and
what else a step takes (the data loader, the boundary's bookkeeping: the launch's step time less
those). Its profile gives the split regions' share s of the FLOPs, the column- and row-wise
layers C and R a forward runs and the row layers' outputs' bytes, all_reduce timed on groups of
each degree (runtime/measure/comm_probe.py `probe_subgroups`), and a split column and row layer
timed on those groups against the same layers unsplit (runtime/measure/split_layer_probe.py):
d_col and d_row, what splitting adds to a layer at a small size (DTensor's dispatch, forward and
backward, and the layer's one all-reduce there) and o_col and o_row, what it adds to the layer's
optimizer step (each op on DTensor parameters dispatched through DTensor). At degree k, micro-batch m' and gas g a ZeRO 0
step is predicted as

    g x (a + (s / k + 1 - s) b m' + C d_col + R d_row
         + (C + R) x (all_reduce_k(row bytes per sample x m') - all_reduce_k(the probe's size)) + other)
      + the optimizer step x (parameters per rank at k / at 1) + C o_col + R o_row

each column layer all-reducing its input's gradient in the backward, each row layer its output
in the forward (torch's ColwiseParallel and RowwiseParallel, as the engine splits a plan), the
bytes past the probe's small size costed by the all_reduce line. From a profile without the
split layers timed (an older record): 2 R all-reduces at the hidden states' size, nothing for
the dispatch. The data-parallel reduction stays inside the backward as degree 1 measured it
(DDP overlaps it), not rescaled to the degree's smaller groups. Pure functions.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autotuner.core.probe_records import CollectiveTiming, SplitLayerTiming
from autotuner.tuning.models.comm_fit import LinkFit, fit_collectives
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState


@dataclass(frozen=True)
class DegreeStep:
    """One predicted step, in seconds, with its parts."""

    compute_s: float  # forward + backward of the step's micro-steps
    tensor_parallel_s: float  # what the split layers add: their dispatch and all-reduces
    other_s: float  # the optimizer step and the rest a step takes

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tensor_parallel_s + self.other_s


@dataclass(frozen=True)
class DegreeTimeModel:
    """What degree 1's ZeRO 0 launches and profile say, to predict another degree's steps."""

    fixed_s: float
    per_sample_s: float
    split_flop_share: float
    row_layers: int
    row_bytes_per_sample: float
    other_per_micro_step_s: float
    optimizer_step_s: float
    params_per_rank: int  # at degree 1: the whole model
    links: dict[int, LinkFit]  # all_reduce by group size
    col_layers: int = 0
    split_layers: dict[int, "SplitCosts"] = dataclasses.field(default_factory=dict)  # by degree

    def predict(self, experiment: Experiment, params_per_rank: int) -> DegreeStep | None:
        """`experiment` at its degree, whose ranks hold `params_per_rank`; None at ZeRO above 0 or
        where no all_reduce was timed at its degree."""
        k = experiment.tensor_parallel
        link = self.links.get(k)
        if experiment.zero_stage != 0 or k <= 1 or link is None:
            return None
        m, gas = experiment.micro_batch_size, experiment.gradient_accumulation_steps
        compute = self.fixed_s + (self.split_flop_share / k + 1 - self.split_flop_share) * self.per_sample_s * m
        payload = self.row_bytes_per_sample * m / max(1, self.row_layers)
        costs = self.split_layers.get(k)
        if costs is not None:
            past_probe = max(0.0, link.seconds(payload) - link.seconds(costs.probe_bytes))
            split = (self.col_layers * costs.col_extra_s + self.row_layers * costs.row_extra_s
                     + (self.col_layers + self.row_layers) * past_probe)
        else:
            split = 2 * self.row_layers * link.seconds(payload) if self.row_layers else 0.0
        step = self.optimizer_step_s * params_per_rank / max(1, self.params_per_rank)
        if costs is not None:
            step += self.col_layers * costs.col_step_extra_s + self.row_layers * costs.row_step_extra_s
        return DegreeStep(gas * compute, gas * split, gas * self.other_per_micro_step_s + step)


@dataclass(frozen=True)
class SplitCosts:
    """What splitting adds to a column and to a row layer at one degree, at the probe's small size."""

    col_extra_s: float
    row_extra_s: float
    probe_bytes: int
    col_step_extra_s: float = 0.0  # what the split parameters add to the optimizer step, a layer
    row_step_extra_s: float = 0.0
    col_floor_s: float = 0.0  # the least a split layer added in any repeat: the bound's
    row_floor_s: float = 0.0

    def floor_per_micro_step(self, col_layers: int, row_layers: int) -> float:
        return col_layers * self.col_floor_s + row_layers * self.row_floor_s

    def per_micro_step(self, col_layers: int, row_layers: int) -> float:
        return col_layers * self.col_extra_s + row_layers * self.row_extra_s


def split_costs(timings: Sequence[SplitLayerTiming]) -> dict[int, SplitCosts]:
    """By degree, where both styles were timed there."""
    found = {}
    for degree in sorted({t.degree for t in timings}):
        by_style = {t.style: t for t in timings if t.degree == degree}
        if "colwise" in by_style and "rowwise" in by_style:
            col, row = by_style["colwise"], by_style["rowwise"]
            found[degree] = SplitCosts(col.extra_s, row.extra_s, col.all_reduce_bytes, col.step_extra_s,
                                       row.step_extra_s, col.floor_extra_s, row.floor_extra_s)
    return found


def micro_step_line(results: Sequence[TrialResult], forward_bound: bool = True) -> tuple[float, float] | None:
    """(a, b): forward + backward seconds per micro-step = a + b x micro-batch, through the fastest
    launch at each size (a held at 0 or above); None under two sizes. Where the times do not grow
    with the micro-batch (a fixed cost per micro-step dominates, or noise), (the fastest, 0): a
    micro-step costs no less than that at any size, and nothing of it is split. `forward_bound`
    (a bound's reading): below ZeRO 3 a launch counts the smaller of its sum and three forwards,
    since a backward may hold the data-parallel reduction; else each launch's sum as measured."""
    fastest: dict[int, float] = {}
    for result in results:
        m = result.measurement
        if result.state is not TrialState.OK or m is None or m.forward is None or m.backward is None:
            continue
        both = m.forward.mean_s + m.backward.mean_s
        seconds = both if result.experiment.zero_stage >= 3 or not forward_bound else min(both, 3 * m.forward.mean_s)
        size = result.experiment.micro_batch_size
        if seconds > 0:
            fastest[size] = min(seconds, fastest.get(size, seconds))
    if len(fastest) < 2:
        return None
    sizes = sorted(fastest)
    slope, intercept = np.polyfit(np.array(sizes, dtype=float), np.array([fastest[s] for s in sizes]), 1)
    if slope <= 0:  # no cost per sample above the noise: a micro-step costs at least the fastest measured
        return min(fastest.values()), 0.0
    return max(0.0, float(intercept)), float(slope)


def all_reduce_floor_s(timings: Sequence[CollectiveTiming], degree: int, world_size: int) -> float:
    """The fastest all_reduce the probe timed on `degree`'s groups at any size (their small sizes
    start at 4 KiB, below a micro-batch's hidden states): no all-reduce on them runs faster than
    that floor. 0 where none was timed."""
    return min((t.seconds for t in _on_groups(timings, degree, world_size) if t.op == "all_reduce"), default=0.0)


def _on_groups(timings: Sequence[CollectiveTiming], degree: int, world_size: int) -> list[CollectiveTiming]:
    """The timings on `degree`'s groups: at the world's degree, the whole group's probe and its
    small sizes (probe_subgroups) together."""
    groups = (0, world_size) if degree == world_size else (degree,)
    return [t for t in timings if t.group_size in groups]


def _flat_link(timings: Sequence[CollectiveTiming]) -> LinkFit | None:
    """Where the times do not grow with the size (latency and noise, as tensor parallelism's small
    all-reduces are on CPU), so no line fits: their median as the latency, and the fastest
    bytes per second seen beyond it."""
    if not timings:
        return None
    return LinkFit("all_reduce", statistics.median(t.seconds for t in timings),
                   max(t.bytes / t.seconds for t in timings))


def degree_time_model(results_at_one: Sequence[TrialResult], world_size: int) -> DegreeTimeModel | None:
    """From degree 1's results (its profile's model info among them); None where they cannot
    say: no ZeRO 0 launches at two micro-batch sizes, no split measured, no subgroup timings."""
    zero = [r for r in results_at_one if r.state is TrialState.OK and r.experiment.zero_stage == 0
            and r.measurement is not None and r.measurement.forward is not None
            and r.measurement.backward is not None and r.measurement.step is not None]
    infos = [r.model_info for r in results_at_one if r.model_info is not None and r.model_info.split_flop_share > 0]
    line = micro_step_line(zero, forward_bound=False)
    if line is None or not infos:
        return None
    info = infos[0]
    timings = [t for r in results_at_one if r.model_info is not None for t in r.model_info.collective_timings]
    links = {}
    for size in range(2, world_size + 1):
        on_groups = [t for t in _on_groups(timings, size, world_size) if t.op == "all_reduce"]
        # (relabelled to one group, so one line fits the small sizes and the large together)
        same = [CollectiveTiming(t.op, t.bytes, t.seconds) for t in on_groups]
        link = fit_collectives(same).get("all_reduce") or _flat_link(same)
        if link is not None:
            links[size] = link
    if not links:
        return None
    others, steps = [], []
    for result in zero:
        m = result.measurement
        gas = result.experiment.gradient_accumulation_steps
        steps.append(m.step.mean_s)
        others.append(max(0.0, m.latency - gas * (m.forward.mean_s + m.backward.mean_s) - m.step.mean_s) / gas)
    fixed, per_sample = line
    return DegreeTimeModel(fixed, per_sample, info.split_flop_share, info.split_row_layers,
                           info.split_row_output_bytes / max(1, info.micro_batch_size), statistics.median(others),
                           min(steps), info.trainable_num_params, links, info.split_col_layers,
                           split_costs(info.split_layer_timings))
