"""`--autotuning plan` at one layout: the candidates the predictive search would choose from, each
costed by the models the profile fitted, nothing launched past the profile.

The rows are the search's own ladder at every stage and variant (the sizes `candidate_space`
keeps, which the search may launch), and the ladder's sizes past what memory lets run (so the
table shows where memory ends). Each row: the memory model's per-rank peak and verdict, the
step-time model's step (the predictive tuner's, floored by a smaller step measured at the same
stage, as the search floors it) and the whole job's samples per second; a row the search would
not choose from says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.searches.predictive_search import candidate_space
from autotuner.tuning.searches.stage_search import OffloadFallback, PredictedLargest
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.trials.evaluator import TuningFailed
from autotuner.tuning.space.search_space import Fits, SearchSpace, ladder_sizes
from autotuner.tuning.tuners.predictive import PredictiveTuner


@dataclass(frozen=True)
class PlanRow:
    """One candidate as the plan costs it. `left_out` is empty for a row the search chooses from."""

    experiment: Experiment
    data_parallel_size: int
    world_size: int
    predicted_memory_bytes: int
    fits: bool
    predicted_step_s: float
    predicted_step_low_s: float
    predicted_step_high_s: float
    predicted_value: float  # the objective's, in its units
    measured_step_s: float | None = None  # a profile launch of this very experiment
    left_out: str = ""

    @property
    def candidate(self) -> bool:
        return not self.left_out

    @property
    def predicted_samples_per_s(self) -> float:
        """The whole job's: the global batch over the step."""
        return self.experiment.train_batch_size(self.data_parallel_size) / self.predicted_step_s


@dataclass(frozen=True)
class PlanModels:
    """What the profile at one layout fitted: the memory model's verdict and peak, the links."""

    fits: Fits
    predicted_memory: Callable[[Experiment], int]
    predicted_largest: PredictedLargest
    offload_fallback: OffloadFallback
    context: CostContext


def plan_rows(space: SearchSpace, objective: Objective, models: PlanModels, measured: list[TrialResult],
              report: Callable[[str], None]) -> list[PlanRow]:
    """Every row of the plan at `space`'s layout, from the profile's `measured` results."""
    pruned: dict[tuple[int, tuple], str] = {}

    def prune(stage: int, reason, text: str, variant: tuple = ()) -> None:  # kept, not written to the ledger
        pruned[(stage, _variant_key(space, stage, variant or space.variants_for(stage)[0]))] = text

    candidates = candidate_space(space, models.predicted_largest, models.fits, prune, models.offload_fallback,
                                 report)
    tuner = PredictiveTuner(candidates, objective, context=models.context)
    for result in measured:
        tuner.observe(result)
    steps = {r.experiment: tuner.measured_step(r) for r in measured}
    if not any(steps.values()):  # a model fitted on nothing would predict any step at all
        raise TuningFailed(f"{space.layout.text()}: no profile launch measured a step, so no step can be predicted")
    chosen = set(candidates)
    rows = []
    for experiment, variant in _rows_experiments(space, candidates).items():
        step = tuner.predicted_step(experiment)
        floor = tuner.step_floor_s(experiment)
        fastest, slowest = (max(bound, floor) for bound in step.bounds())
        fits = models.fits(experiment)
        memory = models.predicted_memory(experiment)
        left_out = "" if experiment in chosen else _why_left_out(pruned.get((experiment.zero_stage, variant)), fits,
                                                                  memory)
        rows.append(PlanRow(experiment, space.data_parallel_size, space.ranks, memory, fits, step.mean_s,
                            fastest, slowest, tuner.predict(experiment).value, steps.get(experiment), left_out))
    return rows


def _rows_experiments(space: SearchSpace, candidates: list[Experiment]) -> dict[Experiment, tuple]:
    """Each stage and variant's ladder over every valid size (its sizes past the memory limit among
    them), and the candidates, each with its variant; in stage, knobs, micro-batch order."""
    found: dict[Experiment, tuple] = {}
    for stage in sorted(space.stages):
        for variant in space.variants_for(stage):
            at = replace(space, stage_knobs=variant) if variant else space
            for size in ladder_sizes(at.valid_micro_batch_sizes(at.max_micro_batch_size)):
                found[at.experiment(stage, size)] = _variant_key(space, stage, variant)
    for candidate in candidates:  # the search's own sizes (and an offload fallback's knobs)
        found.setdefault(candidate, _variant_key(space, candidate.zero_stage, candidate.knobs))
    return dict(sorted(found.items(), key=lambda item: (item[0].zero_stage, item[0].knobs,
                                                        item[0].micro_batch_size)))


def _variant_key(space: SearchSpace, stage: int, knobs: tuple) -> tuple:
    """The values of the stage's variant dimensions among `knobs` (an offload's knobs left aside)."""
    names = {name for variant in space.variants_for(stage) for name, _ in variant}
    return tuple(kv for kv in knobs if kv[0] in names)


def _why_left_out(pruned: str | None, fits: bool, memory: int) -> str:
    if pruned:
        return pruned
    if not fits:
        return f"out of memory by the memory model (predicted {memory / 2**20:.0f} MiB a rank)"
    return ("not among the search's sizes (micro-batch 1 only where nothing larger fits; a variant only above "
            "the sizes its stage reaches without it)")


def predicted_pick(rows: list[PlanRow], objective: Objective) -> PlanRow | None:
    """The candidate the models put first."""
    candidates = [r for r in rows if r.candidate]
    if not candidates:
        return None
    best = candidates[0]
    for row in candidates[1:]:
        if objective.better(row.predicted_value, best.predicted_value):
            best = row
    return best
