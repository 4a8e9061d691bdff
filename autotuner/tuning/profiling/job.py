"""The tuning job as frozen records: settled before any launch (`TuningJob`), then with what the
profile learned (`ProfiledJob`). A phase that learns something builds a new record; none is
changed once built."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from autotuner.core.engine_kind import Engine
from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.memory.estimate import COMPUTE_BYTES, ModelProfile
from autotuner.core import noise_scale as gradient_noise
from autotuner.tuning.models.comm_fit import fit_collectives
from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.models.memory_book import MemoryFacts
from autotuner.tuning.models.transfer import TransferPrior
from autotuner.tuning.space.devices import DeviceFacts
from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.space.layout import Layout
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.trials.runner import Placement
from autotuner.tuning.trials.trial import ExperimentSettings


@dataclass(frozen=True)
class TuningJob:
    """What every launch of the tune shares: the config, the experiments' settings, the space
    searched, the machine's facts and how the search goes. The objective is the settings' (and
    the policy's: `with_objective` keeps them one)."""

    config: DeepSpeedConfig = field(hash=False)
    settings: ExperimentSettings
    space: SearchSpace
    devices: DeviceFacts
    policy: SearchPolicy
    fingerprint: Fingerprint  # what a resume is checked against (the runner's hardware its device)
    placement: Placement  # where the runner runs the experiments, and so where the optimal command trains
    # The layouts searched, each in turn (`at_layout`), where the config asks for a search of the
    # tensor-parallel degree or the pipeline stages (several, or "auto"); the space is at the first.
    # (layout, why) for those left out.
    layouts: tuple[Layout, ...] = ()
    left_out: tuple[tuple[Layout, str], ...] = ()

    @classmethod
    def settled(cls, config: DeepSpeedConfig, settings: ExperimentSettings, space: SearchSpace,
                devices: DeviceFacts, fingerprint: Fingerprint, placement: Placement = Placement(),
                layouts: tuple[Layout, ...] = (), left_out: tuple[tuple[Layout, str], ...] = ()) -> "TuningJob":
        """The job with its search policy derived once, here, from the settings and the config."""
        policy = SearchPolicy.from_tuning(settings.objective, config.autotuning, settings.planned_steps)
        return cls(config, settings, space, devices, policy, fingerprint, placement, layouts, left_out)

    def at_layout(self, layout: Layout) -> "TuningJob":
        """The job of one layout's search: data-parallel size the ranks over the layout's, every
        experiment setting the layout."""
        space = self.space.at_layout(layout, self.space.ranks)
        return replace(self, space=space, settings=replace(self.settings, data_parallel_size=space.data_parallel_size))

    @property
    def objective(self) -> Objective:
        return self.settings.objective

    def with_objective(self, objective: Objective) -> "TuningJob":
        return replace(self, settings=replace(self.settings, objective=objective),
                       policy=replace(self.policy, objective=objective))


@dataclass(frozen=True)
class ProfiledJob:
    """The job as the profile left it (the engine its ranks built, the stages and variants it kept,
    goodput's noise scale), the memory model's facts, and the step-time model's prior from similar
    earlier runs."""

    job: TuningJob
    memory: MemoryFacts
    noise_scale: gradient_noise.NoiseScale | None = None  # metric goodput: what the profile measured
    prior: TransferPrior = TransferPrior()
    profiled: bool = True  # False: the config's model_info stood in for a profile

    def cost_context(self, results: Sequence[TrialResult]) -> CostContext:
        return cost_context(results, self.job.settings.data_parallel_size, self.memory.profile,
                            self.memory.precision, self.memory.engine, self.prior)


def cost_context(results: Sequence[TrialResult], data_parallel_size: int, profile: ModelProfile | None,
                 precision: str, engine: Engine, prior: TransferPrior = TransferPrior()) -> CostContext:
    """What the throughput model knows before timing a step: the model's size and the links the
    profile launches timed on the job's process group."""
    timings = [t for r in results if r.model_info is not None for t in r.model_info.collective_timings]
    links = tuple(fit_collectives(timings).values())
    return CostContext(profile.params_per_rank if profile else 0, data_parallel_size, COMPUTE_BYTES.get(precision, 4),
                       links, prior.observations, engine)
