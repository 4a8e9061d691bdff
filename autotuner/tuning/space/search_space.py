"""What the search ranges over and how it goes: the space (stages, micro-batch sizes with their
gas, and per stage the variants and finishes), the policy (the config's tuner settings), and the
candidate sizes drawn from the space. Pure records and functions: nothing here launches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, runtime_checkable

from autotuner.core.frozen import freeze
from autotuner.config.batch import gas_for, train_batch_size
from autotuner.config.autotuning import AutotuningConfig
from autotuner.tuning.space.records import Objective, TrialResult
from autotuner.tuning.space.experiment import Experiment, Knobs
from autotuner.tuning.space.layout import Layout

Evaluate = Callable[[Experiment], TrialResult]
Fits = Callable[[Experiment], bool]  # the memory model's verdict on one experiment, asked before each launch


@dataclass(frozen=True)
class SearchSpace:
    stages: tuple[int, ...]
    data_parallel_size: int
    min_micro_batch_size: int = 1
    max_micro_batch_size: int = 1024
    fixed_micro_batch_sizes: tuple[int, ...] = ()  # the user's int or list: not searched
    fixed_gradient_accumulation_steps: int | None = None
    global_batch_size: int | None = None  # fixed train_batch_size, or max_train_batch_size
    global_batch_exact: bool = False  # True when train_batch_size is fixed
    num_micro_batch_sizes: int = 3
    knob_values: dict[int, dict[str, list[Any]]] = field(default_factory=dict, hash=False)
    stage_knobs: tuple[tuple[str, Any], ...] = ()  # set on every experiment (offload, when it is needed)
    # Per stage, the variants searched beside it (tuning/space/dimensions.py `variant_values`: activation
    # checkpointing policies, say), least memory-saving first; a stage without any has one, ().
    variants: dict[int, tuple[Knobs, ...]] = field(default_factory=dict, hash=False)
    # Per stage, the finishing dimensions' values (compile), tried last on the best configurations.
    finishes: dict[int, dict[str, list[Any]]] = field(default_factory=dict, hash=False)
    # The tensor-parallel degree and pipeline stages every experiment sets (Experiment.layout; 0: the
    # config's), which `data_parallel_size` is counted at: a layout search has one space per layout.
    tensor_parallel: int = 0
    pipeline: int = 0
    stages_per_rank: int = 0

    def __post_init__(self):
        for name in ("knob_values", "variants", "finishes"):  # read-only at every depth, as the record is
            object.__setattr__(self, name, freeze(getattr(self, name)))

    @property
    def layout(self) -> Layout:
        return Layout(self.tensor_parallel, self.pipeline, self.stages_per_rank)

    @property
    def ranks(self) -> int:
        """The ranks the space's experiments run on (its data-parallel size times its layout's)."""
        return self.data_parallel_size * self.layout.model_ranks

    def at_layout(self, layout: Layout, ranks: int) -> "SearchSpace":
        """This space at `layout` over `ranks`: data-parallel size ranks / the ranks a model spans,
        every experiment setting the layout. A pipeline keeps ZeRO 0 and 1 and no further
        dimension: its engine refuses ZeRO 2 and 3 (as DeepSpeed's does), checkpointing policies and
        compile, and has no DDP buckets for the knobs to move."""
        moved = replace(self, data_parallel_size=ranks // layout.model_ranks, tensor_parallel=layout.tensor_parallel,
                        pipeline=layout.pipeline, stages_per_rank=layout.stages_per_rank)
        if not layout.pipeline:
            return moved
        return replace(moved, stages=tuple(s for s in self.stages if s <= 1), knob_values={}, variants={},
                       finishes={})

    def variants_for(self, stage: int) -> tuple[Knobs, ...]:
        return self.variants.get(stage) or ((),)

    def gas(self, micro_batch_size: int) -> int | None:
        gas = self._gas(micro_batch_size)
        if gas is not None and self.pipeline > 1 and self.stages_per_rank > 1 and gas % max(1, gas // self.pipeline):
            return None  # torch's Interleaved1F1B runs the micro-batches in whole rounds only (LoopedBFS kept alike)
        return gas

    def _gas(self, micro_batch_size: int) -> int | None:
        if self.fixed_gradient_accumulation_steps is not None:
            gas = self.fixed_gradient_accumulation_steps
            total = train_batch_size(micro_batch_size, gas, self.data_parallel_size)
            if self.global_batch_size is not None and (
                total > self.global_batch_size or (self.global_batch_exact and total != self.global_batch_size)
            ):
                return None
            return gas
        return gas_for(micro_batch_size, self.data_parallel_size, self.global_batch_size, self.global_batch_exact)

    def valid_micro_batch_sizes(self, upper: int) -> list[int]:
        """The micro-batch sizes a search may try up to `upper`, each with a valid gas: the one rule
        every search reads. The user's list where they fixed one (an `upper` at or above the
        space's maximum asks for all of it), else every size from the minimum up to the maximum;
        either way none below the minimum, which a variant searched above the sizes the ones before
        it reach raises (stage_search.py `beyond_previous_variant`)."""
        if self.fixed_micro_batch_sizes:
            limit = upper if upper < self.max_micro_batch_size else max(self.fixed_micro_batch_sizes)
            sizes = sorted(set(self.fixed_micro_batch_sizes))
        else:
            limit = min(upper, self.max_micro_batch_size)
            sizes = range(self.min_micro_batch_size, limit + 1)
        return [m for m in sizes if self.min_micro_batch_size <= m <= limit and self.gas(m) is not None]

    def experiment(self, stage: int, micro_batch_size: int) -> Experiment:
        return Experiment(stage, micro_batch_size, self.gas(micro_batch_size) or 1, self.stage_knobs,
                          self.tensor_parallel, self.pipeline, self.stages_per_rank)


@dataclass(frozen=True)
class SearchPolicy:
    """How the search goes. No defaults of its own: they are the config's (from_tuning)."""

    objective: Objective
    tuner_type: str
    early_stopping: int
    num_trials: int
    seed: int
    fast: bool
    planned_steps: int | None = None  # the run's length, settled (ExperimentSettings); None: the steady metric

    @classmethod
    def from_tuning(cls, objective: Objective, tuning: AutotuningConfig,
                    planned_steps: int | None) -> "SearchPolicy":
        return cls(objective, tuning.tuner_type, tuning.tuner_early_stopping, tuning.tuner_num_trials,
                   tuning.tuner_seed, tuning.fast, planned_steps)


def spread_micro_batch_sizes(valid: list[int], largest: int, count: int) -> list[int]:
    """`count` sizes from `valid` up to `largest`, spaced geometrically (largest, ~half, ~quarter, ...)."""
    pool = [m for m in valid if m <= largest]
    if not pool:
        return []
    chosen: list[int] = []
    for k in range(count):
        target = largest / 2**k
        nearest = min(pool, key=lambda m: (abs(math.log(m) - math.log(target)), -m))
        if nearest not in chosen:
            chosen.append(nearest)
    return sorted(chosen, reverse=True)


def fitting_micro_batch_sizes(space: SearchSpace, stage: int, upper: int, fits: Fits) -> list[int]:
    """Valid sizes up to `upper` whose experiment (with its own gas) the memory model lets run.
    Not monotonic in the size: a smaller micro-batch has a larger gas, which can cost more."""
    return [m for m in space.valid_micro_batch_sizes(upper) if fits(space.experiment(stage, m))]


def ladder_sizes(valid: list[int]) -> list[int]:
    """The geometric candidate sizes among `valid`: the one nearest each power of two in its range,
    and its largest (the memory limit), ascending."""
    if not valid:
        return []
    low, high = min(valid), max(valid)
    chosen = {high}
    power = 1
    while power <= 2 * high:
        if power >= low / 2:
            chosen.add(min(valid, key=lambda m: (abs(math.log(m) - math.log(power)), m)))
        power *= 2
    return sorted(chosen)

@runtime_checkable
class ParallelEvaluate(Protocol):
    """An evaluate that can run several experiments at once: `capacity` of them. One that can
    answer some without a launch (the evaluator, from a resumed run's records) also has
    `answer_ready()`, which the parallel driver reads (tuners/base.py `answer_ready`)."""

    capacity: int

    def __call__(self, experiment: Experiment) -> TrialResult: ...

    def submit(self, experiment: Experiment) -> None: ...

    def next_result(self) -> TrialResult:
        """The next submitted experiment to finish, in the order they finish."""

def slots(evaluate: Callable[[Experiment], TrialResult]) -> int:
    """How many experiments `evaluate` runs at once: a plain function, one."""
    return max(1, int(evaluate.capacity)) if isinstance(evaluate, ParallelEvaluate) else 1
