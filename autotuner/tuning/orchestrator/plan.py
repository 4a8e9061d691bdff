"""`--autotuning plan`: each layout's profile, then every candidate costed by the models the
profile fitted; nothing launched past the profiles."""

from __future__ import annotations

from typing import Callable, Protocol

from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.models.memory_book import MemoryBook
from autotuner.tuning.profiling.job import ProfiledJob, TuningJob
from autotuner.tuning.profiling.phase import ProfilePhase
from autotuner.tuning.reports.plan_table import PlanReport
from autotuner.tuning.searches.plan_search import PlanModels, plan_rows, predicted_pick
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.trials.evaluator import TuningFailed
from autotuner.tuning.trials.ledger import TrialLedger


class PlanningTuner(Protocol):
    """What the plan reads of the orchestrator (tune.py's Autotuner)."""

    job: TuningJob
    ledger: TrialLedger
    report: Callable[[str], None]

    def prepare_dirs(self) -> None: ...
    def bound_line(self, layout: Layout, one: Layout | None) -> tuple[bool, str] | None: ...
    def profile_phase(self, layout: Layout) -> ProfilePhase: ...
    def cost_context(self, profiled: ProfiledJob, quiet: bool = False) -> CostContext: ...


def plan_layouts(tuner: PlanningTuner) -> PlanReport:
    """Each layout's profile is launched and recorded as a tune's is, so the same command's tune
    reuses it. A tensor-parallel degree whose bound from degree 1's profile launches cannot beat
    them is not profiled, as in a tune."""
    tuner.prepare_dirs()
    job = tuner.job
    rows = []
    lines = [f"layout: {layout.text()}: left out ({why})" for layout, why in job.left_out]
    objective = job.objective
    profiled_layouts: list[Layout] = []
    for layout in job.layouts or (job.space.layout,):
        searching = bool(job.layouts)
        one = next((done for done in profiled_layouts if done.tensor_parallel <= 1
                    and done.pipeline == layout.pipeline), None)
        bound = tuner.bound_line(layout, one) if searching else None
        if bound is not None:
            tuner.report(bound[1])
            lines.append(bound[1])
            if bound[0]:  # as a tune would: a degree that cannot beat degree 1's best, not profiled
                continue
        try:
            profiled = tuner.profile_phase(layout).run()
        except TuningFailed as failure:
            if len(job.layouts) < 2:
                raise
            lines.append(f"layout: {layout.text()}: left out ({failure})")
            continue
        profiled_layouts.append(layout)
        own = tuner.ledger.view(layout if searching else None)
        memory = MemoryBook(profiled.memory, own.results, tuner.report)
        models = PlanModels(memory.fits, memory.predicted_memory, memory.predicted_largest(),
                            memory.offload_fallback, tuner.cost_context(profiled))
        objective = profiled.job.objective  # goodput's, once a profile measured B_noise
        rows += plan_rows(profiled.job.space, objective, models, list(own.results()), tuner.report)
    if not rows:
        raise TuningFailed("no layout could be profiled: " + "; ".join(lines))
    lines.append(f"plan: {len(rows)} candidates costed from {tuner.ledger.launches} profile launches, nothing "
                 f"else launched; `--autotuning tune` with the same arguments reuses them")
    tuning = job.config.autotuning
    return PlanReport(tuple(rows), predicted_pick(rows, objective), tuple(lines), objective,
                      job.settings.planned_steps, job.config.activation_checkpointing.policy
                      if isinstance(job.config.activation_checkpointing.policy, str) else "none",
                      tuning.cost_per_gpu_hour)
