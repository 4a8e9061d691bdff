"""The profile launches: the first experiments, which also measure the model.

Each writes model_info.json after its first optimizer step (parameter count, bytes autograd
saved for backward, optimizer-state bytes, peak memory) and then times the profile window like
any experiment, so its throughput and steady-state peak count as a measured candidate.

Sizes are far apart, so the memory model's per-sample line is fitted on a real span: a small
micro-batch first (the orchestrator's first choice; should it run out of memory at every stage,
the next, down to the smallest valid size: if that does not fit, nothing does), then the size
the orchestrator chooses from what the first showed (about half the largest predicted to fit; with
similar earlier runs in the history, the size they predict fastest, at least twice the first). The sharded
engine (FSDP2) gets one launch at that size too, since its process overhead differs from DDP's;
unless the orchestrator says sharding cannot win (sharding_gain.py), in which case ZeRO 2 and 3
are left out of the search.

On CUDA the allocator's phase peaks of two launches per engine are also fitted (PeakFit):
forward+backward = fixed + per-sample x micro-batch, and the optimizer step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from autotuner.core.engine_kind import Engine
from autotuner.core.boundary import ModelInfo
from autotuner.tuning.reports.results import measured_engine
from autotuner.tuning.trials.trial import ExperimentSettings
from autotuner.tuning.memory.estimate import ModelProfile, PeakFit, StageSettings, calibrate_baseline, engine_family
from autotuner.tuning.space.records import TrialResult, TrialState

# Runs one profile launch (stage, micro-batch) and returns its result, with model_info when it ran.
ProfileLaunch = Callable[[int, int], TrialResult]
# The second profile size, from the profile the first launch gave (None: no second size).
SecondSize = Callable[[ModelProfile, int], "int | None"]
# Why the sharded engine need not be launched, from the unsharded profile (None: launch it).
ShardingCannotWin = Callable[[ModelProfile, int], "str | None"]


def _sharding_may_win(profile: ModelProfile, stage: int) -> str | None:
    return None


@dataclass(frozen=True)
class ProfileOutcome:
    profile: ModelProfile | None
    device_memory_bytes: int | None
    failure: TrialResult | None  # the launch that failed, when profile is None
    runs: tuple[ModelInfo, ...] = ()  # what the launches that ran recorded (each launch is in the ledger)
    sharding_left_out: str | None = None  # why ZeRO 2 and 3 were not profiled (and are not searched)


def profile_model(stages: tuple[int, ...], settings: ExperimentSettings, launch: ProfileLaunch,
                  first_sizes: tuple[int, ...], second_size: SecondSize, report=print,
                  sharding_cannot_win: ShardingCannotWin = _sharding_may_win) -> ProfileOutcome:
    """Profile at the lowest stage that runs; a higher stage is tried only after an OOM, and the
    next of `first_sizes` only after an OOM at every stage."""
    outcome = None
    for index, first_size in enumerate(first_sizes):
        outcome = _profile_at(stages, settings, launch, first_size, second_size, report, sharding_cannot_win)
        failure = outcome.failure
        if outcome.profile is not None or failure.state is not TrialState.OOM or index + 1 == len(first_sizes):
            break
        report(f"profile: micro-batch {first_size} ran out of memory at every stage; "
               f"trying micro-batch {first_sizes[index + 1]}")
    return outcome


def _profile_at(stages: tuple[int, ...], settings: ExperimentSettings, launch: ProfileLaunch,
                first_size: int, second_size: SecondSize, report,
                sharding_cannot_win: ShardingCannotWin) -> ProfileOutcome:
    last_failure = None

    def run(stage: int, micro: int, what: str = "") -> ModelInfo | None:
        nonlocal last_failure
        report(f"profile: ZeRO {stage}, micro-batch {micro}{what} ...")
        result = launch(stage, micro)
        if result.model_info is None or result.state is not TrialState.OK:
            last_failure = result
            return None
        return result.model_info

    for stage in sorted(stages):
        first = run(stage, first_size)
        if first is None:
            if last_failure.state is not TrialState.OOM:
                break  # a crash will not go away at a higher stage
            continue
        infos = [first]
        profile = _to_profile(infos, settings)
        sizes = [first_size]
        second = second_size(profile, stage)
        if second is not None and second > first_size and (info := run(stage, second)) is not None:
            infos.append(info)
            sizes.append(second)
            profile = _to_profile(infos, settings)
        for warning in blind_spots(infos):
            report(f"warning: {warning}")
        fits = [fit] if (fit := peak_fit(infos)) is not None else []
        sharded = [s for s in stages if s >= 2]
        left_out = sharding_cannot_win(profile, stage) if stage < 2 and sharded else None
        if stage < 2 and sharded and left_out is None:
            # FSDP2's process overhead (DTensor and friends) differs from DDP's: measure it once at
            # the larger size, and on CUDA at both sizes, to fit its allocator peaks too.
            sharded_sizes = sizes if fits else sizes[-1:]
            sharded_infos = []
            for micro in sharded_sizes:
                info = run(max(sharded), micro, " (sharded engine)")
                if info is None:
                    break
                sharded_infos.append(info)
            if sharded_infos:
                infos.extend(sharded_infos)
                profile = _with_sharded_baseline(profile, sharded_infos[0], settings)
            if len(sharded_infos) == len(sharded_sizes) and (fit := peak_fit(sharded_infos)) is not None:
                fits.append(fit)
        profile = replace(profile, peak_fits=tuple(fits))
        return ProfileOutcome(profile, infos[0].device_memory_bytes, None, tuple(infos), left_out)
    return ProfileOutcome(None, None, last_failure)


def blind_spots(infos: list[ModelInfo]) -> list[str]:
    """What the profile could not see, so the memory model is blind there."""
    how = ("give autotuning.model_info (num_params and activation_bytes_per_sample) in the config so the "
           "model need not be measured")
    warnings = []
    if all(info.activation_bytes == 0 for info in infos):
        warnings.append("the profile saw no activations: the script's forward did not go through the engine "
                        "(engine(x)), so the memory model cannot see activation memory; call the engine, or " + how)
    engines = max(info.engines_in_process for info in infos)
    if engines > 1:
        warnings.append(f"the script made {engines} engines; " + measured_engine(infos[0]) + ", so the memory model "
                        "under-counts the others; " + how)
    return warnings


def peak_fit(infos: list[ModelInfo]) -> PeakFit | None:
    """Forward+backward peak = fixed + per-sample x micro-batch through two profile launches of one
    engine, and the optimizer step's peak; None where the peaks were not measured apart (CPU)."""
    if len(infos) < 2 or any(info.forward_backward_peak_bytes is None for info in infos[:2]):
        return None
    first, second = sorted(infos[:2], key=lambda info: info.micro_batch_size)
    span = second.micro_batch_size - first.micro_batch_size
    if span <= 0:
        return None
    per_sample = max(0, (second.forward_backward_peak_bytes - first.forward_backward_peak_bytes) // span)
    fixed = first.forward_backward_peak_bytes - per_sample * first.micro_batch_size
    return PeakFit(zero_stage=first.zero_stage, precision=first.precision, fixed_bytes=int(fixed),
                   per_sample_bytes=int(per_sample),
                   optimizer_step_bytes=max(int(info.optimizer_step_peak_bytes or 0) for info in infos[:2]))


def _per_sample(first_bytes: int, first_micro: int, second_bytes: int, second_micro: int) -> int:
    """The slope between two launches' bytes; one launch's bytes per sample when there is no slope."""
    per_sample = (second_bytes - first_bytes) / max(1, second_micro - first_micro)
    return int(per_sample if per_sample > 0 else first_bytes / first_micro)


def _per_sample_by_policy(first: ModelInfo, second: ModelInfo) -> tuple[tuple[str, int], ...]:
    """Each checkpointing policy's bytes per sample: the slope over both launches where both
    measured it, else the first launch's bytes per sample."""
    later = dict(second.activation_bytes_by_policy)
    return tuple((policy, _per_sample(size, first.micro_batch_size, later.get(policy, size), second.micro_batch_size))
                 for policy, size in first.activation_bytes_by_policy)


def _to_profile(infos: list[ModelInfo], settings: ExperimentSettings) -> ModelProfile:
    first, second = infos[0], infos[-1]
    profile = ModelProfile(
        num_params=first.num_params,
        activation_bytes_per_sample=_per_sample(first.activation_bytes, first.micro_batch_size,
                                                second.activation_bytes, second.micro_batch_size),
        activation_bytes_per_sample_by_policy=_per_sample_by_policy(first, second),
        optimizer_state_bytes_per_param=first.optimizer_state_bytes_per_param,
        num_shard_units=first.num_shard_units,
        engine=first.engine,
        tensor_parallel=first.tensor_parallel,
        split_num_params=first.split_num_params,
        splittable_num_params=first.splittable_num_params,
        split_activation_bytes_per_sample=_per_sample(first.split_activation_bytes, first.micro_batch_size,
                                                      second.split_activation_bytes, second.micro_batch_size),
        pipeline_stage_params=first.stage_num_params,
        pipeline_stage_split_params=first.stage_split_num_params,
        pipeline_stage_activation_bytes_per_sample=tuple(
            _per_sample(one, first.micro_batch_size, other, second.micro_batch_size)
            for one, other in zip(first.stage_activation_bytes, second.stage_activation_bytes)),
        pipeline_schedule=first.pipeline_schedule or "1F1B",
        pipeline_stages_per_rank=max(1, first.pipeline_stages_per_rank),
    )
    # The smaller of the two: the first launch may also have built the script's data cache.
    baseline = min(calibrate_baseline(profile, StageSettings(first.zero_stage, first.precision,
                                                             settings.data_parallel_size,
                                                             gradient_accumulation_steps=max(1, info.pipeline_micro_batches)),
                                      info.micro_batch_size, info.peak_memory_bytes)
                   for info in infos)
    return replace(profile, baseline_bytes=baseline)


def _with_sharded_baseline(profile: ModelProfile, info: ModelInfo, settings: ExperimentSettings) -> ModelProfile:
    stage_settings = StageSettings(info.zero_stage, info.precision, settings.data_parallel_size)
    baseline = calibrate_baseline(profile, stage_settings, info.micro_batch_size, info.peak_memory_bytes)
    return replace(profile, sharded_baseline_bytes=baseline)


def profile_from_config(model_info: Any) -> ModelProfile:
    """`autotuning.model_info` given by the user: no profile run. Unknown activations and
    baseline cost 0, so the first experiments may OOM and the search then backs off."""
    return ModelProfile(
        num_params=model_info.num_params,
        activation_bytes_per_sample=model_info.activation_bytes_per_sample or 0,
        baseline_bytes=model_info.baseline_bytes or 0,
        num_shard_units=model_info.num_layers or 0,
    )


def profile_lines(profile: ModelProfile, engine: Engine) -> list[str]:
    """What the profile measured, said once: the model's size and activations (per checkpointing
    policy where they were measured), then each engine family's fitted peaks."""
    by_policy = dict(profile.activation_bytes_per_sample_by_policy)
    checkpointed = (f" (with activation checkpointing: full {by_policy['full'] / 2**20:.2f}, selective "
                    f"{by_policy['selective'] / 2**20:.2f})" if {"full", "selective"} <= by_policy.keys() else "")
    lines = [f"profile: {profile.num_params:,} parameters, {profile.activation_bytes_per_sample / 2**20:.2f} MiB "
             f"activations per sample{checkpointed}, baseline {profile.baseline_bytes / 2**20:.0f} MiB per rank"]
    if profile.tensor_parallel > 1:
        lines.append(f"profile: tensor parallel {profile.tensor_parallel}: {profile.split_num_params:,} parameters "
                     f"split, {profile.params_per_tp_rank:,} per rank before the ZeRO stage shards them")
    for fit in profile.peak_fits:
        lines.append(f"profile: {engine_family(fit.zero_stage, engine)} measured peaks: forward+backward "
                     f"{fit.fixed_bytes / 2**20:.0f} MiB + {fit.per_sample_bytes / 2**20:.1f} MiB per sample, "
                     f"optimizer step {fit.optimizer_step_bytes / 2**20:.0f} MiB")
    return lines
