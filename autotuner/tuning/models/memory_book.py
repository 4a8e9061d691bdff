"""The tuner's memory bookkeeping: the analytic model for the profiled model, the per-rank budget,
and per engine the residual line fitted to every measured peak (memory/peak_fit.py), refitted after
each launch. The orchestrator asks it one question before every launch: does this fit?

What it stands on (`MemoryFacts`) is a frozen record, settled once the profile (or the config's
model_info) has measured the model; the measured peaks are the trial ledger's results, read from
it, never copied."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence


from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.space import dimensions
from autotuner.tuning.memory.estimate import (ModelProfile, StageSettings, engine_families, engine_family, estimate,
                                     usable_bytes)
from autotuner.tuning.memory.peak_fit import PeakObservation, ResidualFit, fit_residuals
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.space.experiment import Experiment

SAFETY_MARGIN = 0.1


def _user_chose_a_fallback(config: DeepSpeedConfig) -> bool:
    """Whether the user wrote a section of a fallback dimension (offload) at all, any value: then
    their choice stands and no fallback is offered."""
    written = config.dump()
    return any(dimensions.lookup(written, section)[1] is not None for dim in dimensions.REGISTRY.values()
               if dim.fallback for section in dim.user_sections)


def _fixed_values(config: DeepSpeedConfig, on_gpu: bool) -> tuple[tuple[str, object], ...]:
    """The fallback dimensions' values the user fixed (offload "cpu"), folded into every estimate
    through their memory terms; off a GPU those offered on CUDA only are dropped, as the ranks drop them."""
    written = config.dump()
    fixed = []
    for dim in dimensions.REGISTRY.values():
        if not dim.fallback or (dim.cuda_only and not on_gpu):
            continue
        present, value = dimensions.lookup(written, dim.path)
        if present and value is not None and value != "auto" and not isinstance(value, list):
            fixed.append((dim.name, value))
    return tuple(fixed)


def _variant_knobs(experiment: Experiment) -> tuple:
    """The experiment's values of the dimensions that change what runs (not plain knobs)."""
    return tuple(kv for kv in experiment.knobs
                 if kv[0] in dimensions.REGISTRY and dimensions.REGISTRY[kv[0]].role != "knob")


def _policy(experiment: Experiment) -> str:
    """The activation figure the experiment selects (its checkpointing policy; dimensions.py)."""
    return dimensions.activation_value(experiment.knobs)


def memory_budget(per_rank_bytes: int | None, device_memory: int | None, host_memory_bytes: int,
                  nproc_per_node: int) -> int:
    """Bytes per rank: `autotuning.memory_per_rank`, else the ranks' device memory, else the host's
    memory shared by the node's ranks."""
    if per_rank_bytes:
        return per_rank_bytes
    if device_memory:
        return device_memory
    return host_memory_bytes // max(1, nproc_per_node)


@dataclass(frozen=True)
class MemoryFacts:
    """What the memory model stands on: the profiled model and the precision its launches ran in,
    where the ranks run and the budget per rank there, the space searched and the config's ZeRO
    settings. Built once (`memory_facts`); a computation that needs other facts builds its own."""

    config: DeepSpeedConfig = field(hash=False)
    space: SearchSpace
    profile: ModelProfile
    precision: str
    device_type: str  # "cuda" or "cpu": where the ranks run
    budget_bytes: int
    # The config's scalar ZeRO settings besides the stage (they change the engine's buffers).
    zero_settings: tuple[tuple[str, Any], ...] = ()
    contiguous_gradients: bool = False

    @property
    def engine(self) -> str:
        return self.profile.engine


def memory_facts(config: DeepSpeedConfig, space: SearchSpace, profile: ModelProfile, precision: str,
                 device_memory: int | None, host_memory_bytes: int, nproc_per_node: int,
                 zero: dict[str, Any]) -> MemoryFacts:
    """The facts once the device the ranks run on is known (the profile launch reads its memory;
    the tuner's host may have none, a Slurm login node say); the budget is `memory_budget`'s."""
    budget = memory_budget(config.autotuning.memory_per_rank_bytes, device_memory, host_memory_bytes, nproc_per_node)
    settings = tuple(sorted((k, v) for k, v in zero.items() if k != "stage" and isinstance(v, (bool, int, float, str))))
    return MemoryFacts(config, space, profile, precision, "cuda" if device_memory else "cpu", budget, settings,
                       bool(zero.get("contiguous_gradients")))


def peak_results(results: Sequence[TrialResult]) -> list[TrialResult]:
    """The launches with a measured peak, or out of memory without one (a lower bound: the budget)."""
    return [r for r in results if r.measured_memory_bytes is not None or r.state is TrialState.OOM]


class MemoryBook:
    """Bytes per rank for any experiment, as well as the launches so far let us know them: the
    facts, and the peaks of the results `results` gives (the ledger's), refitted by `learn`."""

    def __init__(self, facts: MemoryFacts, results: Callable[[], Sequence[TrialResult]],
                 report: Callable[[str], None] = lambda line: None):
        self.facts = facts
        self._results = results
        self.report = report
        self._fixed = _fixed_values(facts.config, facts.device_type == "cuda")  # the user's fixed fallback values
        self._peak_results: list[TrialResult] = []
        self._residual_fits: dict[str, ResidualFit] = {}
        self.refit()

    # ----- what is known -----
    @property
    def engine(self) -> str:
        return self.facts.engine

    @property
    def space(self) -> SearchSpace:
        return self.facts.space

    @property
    def profile(self) -> ModelProfile:
        return self.facts.profile

    @property
    def precision(self) -> str:
        return self.facts.precision

    @property
    def budget_bytes(self) -> int:
        return self.facts.budget_bytes

    @property
    def device_type(self) -> str:
        return self.facts.device_type

    def family(self, stage: int) -> str:
        return engine_family(stage, self.engine)

    def fit_family(self, experiment: Experiment) -> str:
        """The residual line an experiment's peak joins: its engine's, apart under activation
        checkpointing (a policy keeps its own share of each sample's bytes)."""
        policy = _policy(experiment)
        family = self.family(experiment.zero_stage)
        return family if policy == "none" else f"{family}, {policy} checkpointing"

    def report_budget(self, environ: dict[str, str]) -> None:
        """The settled budget, said once, with the CPU note where it applies."""
        self.report(f"memory budget: {self.budget_bytes / 2**20:.0f} MiB per rank (safety margin {SAFETY_MARGIN:.0%})")
        if (note := self.budget_note(environ)) is not None:
            self.report(note)

    def budget_note(self, environ: dict[str, str]) -> str | None:
        """On a CPU under a given budget, what makes the resident set predictable, when it is not set.
        Not set for the user: it holds peaks within 1 MiB run to run, but cost 0.59-0.87x the
        throughput on four of five CPU workloads (1 MiB and 8 MiB thresholds 0.69-0.90x), which
        every measurement, and the training the pick is run with, would pay
        (benchmarks/malloc_threshold.py, benchmarks/results/malloc_threshold*.csv)."""
        if self.device_type != "cpu" or not self.facts.config.autotuning.memory_per_rank_bytes:
            return None
        if "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
            return None
        return ("note: on a CPU a rank's resident set follows glibc's heap, whose peaks vary by up to 40% run to run "
                "(FSDP2's doubled on one workload), so a launch may overrun memory_per_rank_bytes and count as out of "
                "memory; MALLOC_MMAP_THRESHOLD_=131072 in the launcher's environment holds them within 1 MiB, at "
                "0.59-0.87x the throughput on our CPU workloads, so it is yours to set (docs/autotuning.md)")

    def stage_settings(self, stage: int, gradient_accumulation_steps: int = 1,
                       knobs: tuple[tuple[str, Any], ...] = ()) -> StageSettings:
        # Ranks on a CPU-only machine drop offload (everything is host memory already).
        facts = self.facts
        settings = StageSettings(stage, facts.precision, facts.space.data_parallel_size, False, False,
                                 facts.contiguous_gradients, gradient_accumulation_steps, facts.zero_settings)
        for name, value in (*self._fixed, *knobs):
            settings = dimensions.memory_term(settings, name, value)
        return settings

    # ----- predictions -----
    def analytic_memory(self, experiment: Experiment) -> int:
        """The analytic model's bytes per rank for `experiment`, before any fitted correction."""
        settings = self.stage_settings(experiment.zero_stage, experiment.gradient_accumulation_steps,
                                       experiment.knobs)
        return estimate(self.profile, settings, experiment.micro_batch_size).total

    def _residual_fit(self, experiment: Experiment) -> ResidualFit | None:
        """The experiment's own fit; under a checkpointing policy not measured yet, its engine's
        whole (what the saved bytes miss, backward's gradient temporaries and allocator slack,
        does not shrink with the policy: measured on CPU, scaling it by the policy's share
        under-predicted by 17-28%); else the other engine's (an engine not measured yet borrows
        it: allocator slack and under-counted activations are alike in both)."""
        return (self._residual_fits.get(self.fit_family(experiment))
                or self._residual_fits.get(self.family(experiment.zero_stage))
                or next(iter(self._residual_fits.values()), None))

    def predicted_memory(self, experiment: Experiment) -> int:
        """Bytes per rank: the analytic model plus the residual line fitted to measured peaks. A
        variant not measured yet (a checkpointing policy, compile, offload: dimensions whose role is
        not "knob") borrows no downward correction: compiled variants of a block stack peaked 8-10%
        above a fit learnt on their eager twins (issue 49), so until one of its own peaks is in,
        it gets the analytic model where the borrowed fit would lower it."""
        fit = self._residual_fit(experiment)
        correction = fit.bytes_at(experiment.micro_batch_size) if fit is not None else 0
        if correction < 0 and not self._variant_measured(experiment):
            correction = 0
        return self.analytic_memory(experiment) + correction

    def correction(self, experiment: Experiment) -> int:
        """What the fitted residual adds to the analytic bytes for `experiment` (0 without a fit)."""
        return self.predicted_memory(experiment) - self.analytic_memory(experiment)

    def _variant_measured(self, experiment: Experiment) -> bool:
        own = _variant_knobs(experiment)
        return any(r.state is TrialState.OK and r.measured_memory_bytes and _variant_knobs(r.experiment) == own
                   for r in self._peak_results)

    def fits(self, experiment: Experiment) -> bool:
        """The verdict before a launch. Until peaks of the experiment's own engine were measured it
        keeps the whole safety margin; on a CPU, once its fit rests on them, half the margin is left
        for the noise in measured peaks up to the largest size measured. A micro-batch no smaller than one that ran out of memory at the
        same stage and knobs never fits, whatever a fit over several launches says: activations
        only grow with it (a smaller gas frees nothing at the peak)."""
        if any(r.state is TrialState.OOM and r.experiment.zero_stage == experiment.zero_stage
               and r.experiment.knobs == experiment.knobs and r.experiment.micro_batch_size <= experiment.micro_batch_size
               for r in self._peak_results):
            return False
        # A checkpointing policy not launched yet stands on its engine's measured fit (its share of
        # the bytes was measured on the same profile step).
        family = next((f for f in (self.fit_family(experiment), self.family(experiment.zero_stage))
                       if f in self._residual_fits), None)
        # On a CPU the fitted quantity (the RSS) is the limited one, so half the margin covers the
        # noise where the fit interpolates. Beyond the largest size it measured it extrapolates, and
        # the RSS noise (~10% here) made a launch predicted at 94% of the budget peak 1% over it. On a
        # GPU the fit is of allocated bytes while the caching allocator's reserved slack is what runs
        # out: a ZeRO-0 launch predicted at 94% of an H200's room ran out of memory. Both keep the
        # whole margin.
        interpolated = (family is not None and self._residual_fits[family].measured_points
                        and self.device_type == "cpu"
                        and experiment.micro_batch_size <= self._largest_measured(family))
        margin = SAFETY_MARGIN / 2 if interpolated else SAFETY_MARGIN
        return self.predicted_memory(experiment) <= usable_bytes(self.budget_bytes, margin)

    def _largest_measured(self, family: str) -> int:
        """The largest micro-batch whose peak was measured in this fit family (0: none)."""
        return max((r.experiment.micro_batch_size for r in self._peak_results
                    if r.measured_memory_bytes is not None and self.fit_family(r.experiment) == family), default=0)

    def predicted_largest(self) -> dict[Any, int]:
        """Per stage, the largest micro-batch whose experiment (with its own gas) is predicted to
        fit; per (stage, variant) too, for each variant searched beside a stage (searches/stage_search.py)."""
        largest: dict[Any, int] = {}
        for stage in self.space.stages:
            for variant in self.space.variants_for(stage):
                space = replace(self.space, stage_knobs=variant)
                fitting = [m for m in space.valid_micro_batch_sizes(space.max_micro_batch_size)
                           if self.fits(space.experiment(stage, m))]
                largest[(stage, variant) if variant else stage] = max(fitting, default=0)
        return largest

    def offload_fallback(self, stage: int, variant: tuple[tuple[str, Any], ...] = ()) -> tuple[dict[str, Any], int] | None:
        """For a ZeRO 2/3 stage that fits nothing on the GPU: CPU offload and the largest micro-batch
        it allows. Not offered when the user configured offload (their choice stands) or off CUDA
        (torch's CPUOffloadPolicy needs a GPU). DeepSpeed offloads parameters only at stage 3, and
        on its own engine the optimizer from stage 1 on."""
        knobs = dimensions.fallback_knobs(stage, self.engine)
        if knobs is None or self.device_type != "cuda" or _user_chose_a_fallback(self.facts.config):
            return None
        usable = usable_bytes(self.budget_bytes, SAFETY_MARGIN)
        space = replace(self.space, stage_knobs=tuple(sorted({**dict(variant), **knobs}.items())))
        fitting = [m for m in space.valid_micro_batch_sizes(self.space.max_micro_batch_size)
                   if self.predicted_memory(space.experiment(stage, m)) <= usable]
        return (knobs, max(fitting)) if fitting else None

    # ----- learning from launches -----
    def learn(self, result: TrialResult) -> None:
        """`result` was recorded: with a peak (or out of memory), refit and say the new line."""
        if result.measured_memory_bytes is None and result.state is not TrialState.OOM:
            return
        self.refit()
        self.report_fit(self.fit_family(result.experiment))

    def refit(self) -> None:
        """Fit every peak recorded so far, against the analytic model at the facts' precision (a
        phase fit applies only at its own: refitted under the default fp32 after a bf16 profile,
        an H200 launch was predicted 13.6% high)."""
        self._peak_results = peak_results(self._results())
        # The total per-sample cost never goes negative: the analytic activations bound the slope
        # (a checkpointing policy's own bytes per sample bound its family's).
        floors = {family: -float(self.profile.activation_bytes_per_sample) for family in engine_families(self.engine)}
        for result in self._peak_results:
            policy = _policy(result.experiment)
            floors[self.fit_family(result.experiment)] = -float(self.profile.activation_bytes_per_sample_for(policy))
        # Without a profile's per-sample bytes (model_info given), a lone peak's excess is per-sample.
        self._residual_fits = fit_residuals(self._peak_observations(), floors,
                                            per_sample_when_alone=self.profile.activation_bytes_per_sample == 0)

    def report_fits(self) -> None:
        for family in sorted(self._residual_fits):
            self.report_fit(family)

    def report_fit(self, family: str) -> None:
        fit = self._residual_fits.get(family)
        if fit is not None:
            self.report(f"memory model: {family} fitted on {fit.measured_points} measured peak(s): analytic + "
                        f"{fit.fixed_bytes / 2**20:.0f} MiB + {fit.per_sample_bytes / 2**20:.2f} MiB per sample"
                        + (f", {fit.slope_above_pivot / 2**20:.2f} MiB per sample above micro-batch {fit.pivot}"
                           if fit.slope_above_pivot is not None else "") + f" ({fit.slope_source})")

    def _peak_observations(self) -> list[PeakObservation]:
        """The measured peaks against the analytic model as it stands now (the profile refines it)."""
        observations = []
        for result in self._peak_results:
            measured, lower_bound = result.measured_memory_bytes, False
            if measured is None:
                measured, lower_bound = self.budget_bytes, True
            experiment = result.experiment
            observations.append(PeakObservation(self.fit_family(experiment), experiment.micro_batch_size,
                                                self.analytic_memory(experiment), measured, lower_bound))
        return observations
