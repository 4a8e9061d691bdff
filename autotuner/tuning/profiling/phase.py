"""The profile phase: from the settled job to the profiled one.

It runs the profile launches (launches.py), or reads the config's model_info instead, and
returns a `ProfiledJob`: the job with the engine the first launch's ranks built, the stages and
checkpointing variants the profile kept, goodput's objective, and the memory model's facts. Each
step returns a new record; the one job the phase holds is replaced once, when the first launch's
ranks settle the engine. What the launches measured is the ledger's.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from autotuner.core.engine_kind import Engine
from autotuner.tuning.memory.estimate import ModelProfile
from autotuner.core import noise_scale as gradient_noise
from autotuner.tuning.models.cost_model import NOISE_FLOOR
from autotuner.tuning.models.memory_book import MemoryBook, MemoryFacts, memory_facts
from autotuner.tuning.models.sharding_gain import sharding_cannot_win
from autotuner.tuning.profiling.job import ProfiledJob, TuningJob, cost_context
from autotuner.tuning.profiling.launches import profile_from_config, profile_lines, profile_model
from autotuner.tuning.searches.variant_rules import checkpointing_settled
from autotuner.tuning.space.config_space import engine_dimensions, untuned_dimension_lines
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import Objective, Reason, TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchSpace, ladder_sizes
from autotuner.tuning.trials.evaluator import Evaluator, TuningFailed
from autotuner.tuning.trials.ledger import TrialKind, TrialLedger
from autotuner.tuning.trials.similar_runs import SimilarRuns
from autotuner.tuning.trials.trial import rescored

# The first profile launch's largest gas: each accumulation step is a whole forward/backward pass.
PROFILE_MAX_GAS = 8


def record_pruned(ledger: TrialLedger, space: SearchSpace, predicted: Callable[[Experiment], int],
                  report: Callable[[str], None], stage: int, reason: Reason, text: str, variant: tuple = ()) -> None:
    """A stage (or a variant of it: `text` then starts with the variant) not searched further,
    into the ledger with its reason, and said."""
    experiment = space.experiment(stage, space.min_micro_batch_size).with_knobs(dict(variant))
    ledger.record_pruned(TrialResult(experiment, TrialState.PRUNED, error=text, reason=reason,
                                     predicted_memory_bytes=predicted(experiment)))
    searched = "not launched" if reason.never_launched else "not searched further"
    report(f"ZeRO {stage}: pruned, {searched} ({text})")


class ProfilePhase:
    """`settle_engine` is given the engine the first profile launch's ranks built when the settings
    had not settled it (or expected the other): it refuses what is wrong for that engine (raising
    a ConfigError), else returns the line to report."""

    def __init__(self, job: TuningJob, ledger: TrialLedger, evaluator: Evaluator, report: Callable[[str], None],
                 settle_engine: Callable[[str], str], similar_runs: SimilarRuns, exps_dir: Path):
        # The job the launches are built from: replaced once, where the first launch's ranks settle
        # the engine (_follow_engine); every later step returns a new record instead.
        self.job = job
        self._ledger = ledger  # written: pruned stages, the scoring
        self._evaluator = evaluator
        self._view = evaluator.view  # read: this layout's records
        self._report = report
        self._settle_engine = settle_engine
        self._similar_runs = similar_runs
        self._exps_dir = exps_dir

    def run(self) -> ProfiledJob:
        profiled = self._settle_goodput(self._measure_model())
        job = profiled.job  # the dimensions offered now follow the engine the profile's ranks built
        for line in untuned_dimension_lines(job.config, job.space, job.settings.engine, job.devices.on_gpu):
            self._report(line)
        context = profiled.cost_context(self._view.results())
        prior = self._similar_runs.prior(  # the step-time model's prior, checked against the profile
            profiled.memory.profile, list(self._view.of_kind(TrialKind.PROFILE)), lambda: context, self._report)
        return replace(profiled, prior=prior)

    # ----- the launches -----
    def _launch(self, stage: int, micro_batch_size: int) -> TrialResult:
        """A profile launch is the experiment at that stage and size (with its own gas), which also
        records the model; it counts as that experiment's measurement (under the stage's first
        variant, which the base config holds). The first that ran settles the engine."""
        space = self.job.space
        experiment = space.experiment(stage, micro_batch_size).with_knobs(dict(space.variants_for(stage)[0]))
        result = self._evaluator.profile(experiment)
        if result.model_info is not None:
            self._follow_engine(result.model_info.engine)
        return result

    def _follow_engine(self, built: str) -> None:
        """The profile launch's ranks say whose engine the script trains on. Where the settings had
        not settled it (a script that imports both engines) or expected the other (one that reaches
        deepspeed through a module not read), `settle_engine` refuses what is wrong for it, and the
        experiments' configs, the memory model and the searched dimensions follow it."""
        job = self.job
        if job.settings.engine_settled and built == job.settings.engine:
            return
        self._report(self._settle_engine(built))
        space = job.space
        if built != job.settings.engine:
            space = replace(space, **engine_dimensions(job.config, built, job.devices.on_gpu))
        self.job = replace(job, space=space, settings=replace(job.settings, engine=built, engine_settled=True))
        # The launches from here on are built from the settled job's settings.
        self._evaluator = self._evaluator.for_job(replace(self._evaluator.trials, settings=self.job.settings))

    def _facts(self, space: SearchSpace, profile: ModelProfile, precision: str,
               device_memory: int | None) -> MemoryFacts:
        job = self.job
        return memory_facts(job.config, space, profile, precision, device_memory, job.devices.host_memory_bytes,
                            job.settings.nproc_per_node, job.settings.base_config["zero_optimization"])

    def _book(self, profile: ModelProfile, precision: str, device_memory: int | None) -> MemoryBook:
        """The memory model on a profile the phase is still measuring, over the peaks so far."""
        return MemoryBook(self._facts(self.job.space, profile, precision, device_memory), self._view.results)

    def _size_pool(self) -> list[int]:
        space = self.job.space
        return space.valid_micro_batch_sizes(space.max_micro_batch_size)

    def _profile_sizes(self) -> tuple[tuple[int, ...], Callable[[ModelProfile, int], int | None]]:
        """The first profile sizes to try, in order, and how the second size is chosen: about half
        the largest size the first launch predicts to fit, on the candidate ladder.

        The first is the smallest ladder size whose gas is at most PROFILE_MAX_GAS: with a global
        batch, the smallest valid size has the largest gas (micro-batch 1 x gas 64 runs 64
        forward/backward passes per step, several times a size-8 launch's time). Should it run
        out of memory at every stage, the smallest valid size is tried (if it does not fit,
        nothing does)."""
        space = self.job.space
        pool = self._size_pool()
        if not pool:
            return (space.min_micro_batch_size,), lambda profile, stage: None
        cheap = next((m for m in ladder_sizes(pool) if (space.gas(m) or 1) <= PROFILE_MAX_GAS), pool[0])
        first_sizes = (cheap, pool[0]) if cheap != pool[0] else (pool[0],)

        def second(profile: ModelProfile, stage: int) -> int | None:
            # This stage's first launch: the latest that ran (one at a lower stage may have run out of memory).
            first = next(r for r in reversed(self._view.results())
                         if r.model_info is not None and r.state is TrialState.OK)
            book = self._book(profile, first.model_info.precision, first.model_info.device_memory_bytes)
            fitting = [m for m in pool if book.fits(self.job.space.experiment(stage, m))]
            if not fitting:
                return None
            # Cold or with similar earlier runs alike: a prior's choice here, checked against one
            # launch only, sent the profile to its own best size, and a model of another shape
            # (four times wider, say) was then picked 2%+ behind in a third of simulated tunes
            # (benchmarks/transfer_simulated.py, docs/benchmarks/transfer.md).
            target = max(fitting) / 2
            below = [m for m in ladder_sizes(fitting) if m <= target] or [min(fitting)]
            return max(below)

        return first_sizes, second

    def _sharding_cannot_win(self, profile: ModelProfile, stage: int) -> str | None:
        """sharding_gain.py's verdict from the unsharded profile launches: does every size fit
        unsharded, and what do the probe's links cost FSDP2's collectives at."""
        results = self._view.results()
        ran = [r for r in results if r.model_info is not None]
        steps = [r.measurement.latency for r in results
                 if r.state is TrialState.OK and r.measurement is not None and r.measurement.latency > 0]
        if not steps:
            return None
        first = ran[0].model_info
        latest = next(r.model_info for r in reversed(ran) if r.state is TrialState.OK)
        book = self._book(profile, first.precision, latest.device_memory_bytes)
        space = self.job.space
        unsharded = [s for s in space.stages if s < 2]
        fits_all = all(any(book.fits(space.experiment(s, m)) for s in unsharded) for m in self._size_pool())
        context = cost_context(results, self.job.settings.data_parallel_size, profile, first.precision,
                               profile.engine)
        return sharding_cannot_win(space.stages, fits_all, context, min(steps), NOISE_FLOOR)

    # ----- the model -----
    def _measure_model(self) -> ProfiledJob:
        tuning = self.job.config.autotuning
        if tuning.model_info is not None and tuning.model_info.num_params:
            return self._given_model()
        first_sizes, second_size = self._profile_sizes()
        outcome = profile_model(self.job.space.stages, self.job.settings, self._launch, first_sizes, second_size,
                                report=self._report, sharding_cannot_win=self._sharding_cannot_win)
        if outcome.profile is None:
            failure = outcome.failure
            where = self._exps_dir / failure.experiment.name
            raise TuningFailed(f"the model did not run in the profile launch ({failure.state.value}): "
                               f"{failure.error}; see {where}/stderr.log")
        job, profile = self.job, outcome.profile
        space = job.space
        if outcome.sharding_left_out:
            space = replace(space, stages=tuple(s for s in space.stages if s < 2))
        space, checkpointing_line = checkpointing_settled(
            space, dict(profile.activation_bytes_per_sample_by_policy), True)
        facts = self._facts(space, profile, outcome.runs[0].precision, outcome.device_memory_bytes)
        book = MemoryBook(facts, self._view.results, self._report)
        if outcome.sharding_left_out:
            for stage in [s for s in job.space.stages if s >= 2]:
                record_pruned(self._ledger, job.space, book.predicted_memory, self._report, stage,
                              Reason.SHARDING_CANNOT_WIN, outcome.sharding_left_out)
        if profile.engine == Engine.DEEPSPEED:
            self._report("engine: the script trains on DeepSpeed's own engine (DeepSpeedEngine); every experiment "
                         "runs there, costed by DeepSpeed's ZeRO memory model")
        book.report_fits()
        for line in profile_lines(profile, book.engine):
            self._report(line)
        return self._settled(replace(job, space=space), book, checkpointing_line, profiled=True)

    def _given_model(self) -> ProfiledJob:
        """`autotuning.model_info` stands in for the profile: no launch."""
        job = self.job
        profile = replace(profile_from_config(job.config.autotuning.model_info), engine=job.settings.engine)
        precision = job.config.with_device_precision(job.devices.cuda_bf16).precision
        self._report(f"model_info given: {profile.num_params:,} parameters; no profile run")
        space, line = checkpointing_settled(job.space, dict(profile.activation_bytes_per_sample_by_policy), False)
        book = MemoryBook(self._facts(space, profile, precision, job.devices.gpu_memory_bytes), self._view.results,
                          self._report)
        return self._settled(replace(job, space=space), book, line, profiled=False)

    def _settled(self, job: TuningJob, book: MemoryBook, checkpointing_line: str | None,
                 profiled: bool) -> ProfiledJob:
        if checkpointing_line:
            self._report(checkpointing_line)
        book.report_budget(dict(os.environ))
        return ProfiledJob(job, book.facts, profiled=profiled)

    # ----- goodput -----
    def _settle_goodput(self, profiled: ProfiledJob) -> ProfiledJob:
        """metric "goodput": B_noise from the profile launches' gradient norms (or the user's
        critical_batch_size in its place), then every result so far judged again with it. Where
        neither is known, one line, and throughput decides."""
        job = profiled.job
        current = job.objective
        if current.metric != "goodput":
            return profiled
        measured = [r.measurement for r in self._view.results() if r.measurement is not None]
        noise = gradient_noise.estimate(measured)
        given = job.config.autotuning.critical_batch_size
        report = self._report
        late = None if given is not None or profiled.memory.profile is None else self._similar_runs.late_noise(
            profiled.memory.profile, list(self._view.of_kind(TrialKind.PROFILE)))
        if late is not None:
            b_noise, study, step = late
            objective = replace(current, noise_scale=b_noise)
            profiled_text = (f"the profile's B_noise {noise.b_noise:.1f} +/- {noise.spread:.1f}" if noise is not None
                             else "the profile did not measure B_noise")
            report(f"goodput: B_noise {b_noise:.1f}, read at step {step} of an earlier run's training (study {study}, "
                   f"the same model family), stands in as a critical batch would ({profiled_text}); each candidate "
                   f"scores its throughput x ({b_noise:.1f} + {objective.reference_batch}) / ({b_noise:.1f} + its "
                   "global batch)")
        elif given is not None:
            objective = replace(current, noise_scale=float(given))
            profiled_text = (f"the profile's B_noise {noise.b_noise:.1f} +/- {noise.spread:.1f}" if noise is not None
                             else "the profile did not measure B_noise")
            report(f"goodput: critical batch {given} (autotuning.critical_batch_size; {profiled_text}); each "
                   f"candidate scores its throughput x ({given} + {objective.reference_batch}) / ({given} + its "
                   f"global batch)")
        elif noise is None:
            why = ("too few steps, or noise that swamps the gradient: lengthen the profile window"
                   if any(m.gradient_norms for m in measured) else
                   "it is read on our engine at ZeRO 0 or 1, around the all-reduce with two ranks or more, or over "
                   "the micro-steps of one rank's gradient accumulation, and on DeepSpeed's engine at ZeRO 0 with "
                   "two ranks or more, and no profile launch ran so")
            report(f"goodput: the gradient noise scale was not measured ({why}); scoring by throughput")
            # The learning rate still follows the pick's global batch (lr_scaling), from the same reference.
            objective = Objective("throughput", reference_batch=current.reference_batch)
        else:
            objective = replace(current, noise_scale=noise.b_noise)
            report(f"goodput: gradient noise scale B_noise = {noise.b_noise:.1f} +/- {noise.spread:.1f} samples "
                   f"({noise.steps} steps of the profile); each candidate scores its throughput x "
                   f"(B_noise + {objective.reference_batch}) / (B_noise + its global batch). B_noise this early "
                   f"in training can be far below the critical batch at the loss you train to (15-65x on "
                   f"docs/benchmarks/goodput.md's tasks); where you know it, set autotuning.critical_batch_size")
        job = job.with_objective(objective)
        self._ledger.score_with(lambda result: rescored(result, job.settings))  # the records stay as measured
        return replace(profiled, job=job, noise_scale=noise)

