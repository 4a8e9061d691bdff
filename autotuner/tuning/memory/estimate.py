"""Memory model: bytes per rank for a ZeRO stage, precision and micro-batch. Pure functions.

It costs what our engine really holds (see autotuner/runtime/training/sharding.py):
- stage 0/1 (DDP): fp32 parameters and gradients, plus DDP's gradient buckets (a second
  gradient copy unless `contiguous_gradients` makes gradients views into the buckets);
  bf16/fp16 run under autocast, which keeps a low-precision copy of the weights;
  stage 1 shards only the optimizer states (ZeroRedundancyOptimizer).
- stage 2/3 (FSDP2): fp32 parameters, gradients and optimizer states sharded over the
  ranks; the unsharded compute copy (2 bytes in bf16/fp16, 4 in fp32) is held whole
  from forward to backward in stage 2, and one or two blocks at a time in stage 3;
  with gradient accumulation, unsharded gradients are held between micro-steps.
- offload (stage 2/3): FSDP2's CPUOffloadPolicy keeps the sharded fp32 parameters and
  gradients on the host and steps the optimizer there, so either `offload_optimizer` or
  `offload_param` leaves only the compute copies and activations on the device.
A pipeline is costed stage by stage (pipeline_stages.py). Activations come from the profile run, per activation checkpointing policy (the bytes each
policy would hold, measured on the profile's own step). `baseline_bytes` is what the process holds
before the model (CUDA context, or on CPU the interpreter and libraries).

A script that trains on DeepSpeed's own engine (`engine == Engine.DEEPSPEED`) is costed from
DeepSpeed's formulas instead (deepspeed_states.py); each engine's families are fitted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autotuner.core.engine_kind import Engine
from autotuner.tuning.memory.deepspeed_states import deepspeed_state_bytes
from autotuner.tuning.memory.pipeline_stages import stage_estimates

BYTES_FP32 = 4
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PeakFit:
    """Allocator peaks measured for one engine (DDP or FSDP2) at two micro-batch sizes, in the
    steady state (CUDA): forward+backward = fixed + per_sample x micro-batch, and the optimizer
    step's own peak, which does not grow with the micro-batch. The peak is the larger of the two."""

    zero_stage: int  # the stage the profile launches ran; other stages of the engine differ by the analytic model
    precision: str
    fixed_bytes: int
    per_sample_bytes: int
    optimizer_step_bytes: int
    gradient_accumulation_steps: int = 1


@dataclass(frozen=True)
class ModelProfile:
    """What the memory model needs to know about the model, per rank."""

    num_params: int
    activation_bytes_per_sample: int
    optimizer_state_bytes_per_param: float = 8.0  # Adam/AdamW: two fp32 moments
    baseline_bytes: int = 0
    num_shard_units: int = 0  # blocks FSDP2 shards separately (0: unknown)
    sharded_baseline_bytes: int | None = None  # stage 2/3 process overhead, when measured apart (DTensor)
    peak_fits: tuple[PeakFit, ...] = ()  # measured on CUDA; they replace the analytic sum for their engine
    engine: Engine = Engine.OURS  # whose engine the profile ran on
    # Per activation checkpointing policy, the bytes per sample it would hold at its peak
    # (ModelInfo.activation_bytes_by_policy over the profiled micro-batches); empty if not measured.
    activation_bytes_per_sample_by_policy: tuple[tuple[str, int], ...] = ()
    # Tensor parallelism the profile ran with: the parameters its plan split (whole counts) lie
    # split over `tensor_parallel` ranks, the rest whole on each; the ZeRO stage then shards a
    # rank's share over the data-parallel ranks (never the whole model over both, DeepSpeed issue 6796).
    tensor_parallel: int = 1
    split_num_params: int = 0
    # A profile at degree 1: what a degree would split (the plan's parameters, whole counts, and the
    # activation bytes per sample saved inside its split regions; degree_prediction.py).
    splittable_num_params: int = 0
    split_activation_bytes_per_sample: int = 0
    # A pipeline's profile (pipeline_stages.py): per stage, the parameters its ranks hold and the bytes
    # one sample's activations take there, and the schedule, which sets the micro-batches in flight.
    pipeline_stage_params: tuple[int, ...] = ()
    pipeline_stage_split_params: tuple[int, ...] = ()  # of those, split over `tensor_parallel` ranks
    pipeline_stage_activation_bytes_per_sample: tuple[int, ...] = ()
    pipeline_schedule: str = "1F1B"
    pipeline_stages_per_rank: int = 1

    @property
    def params_per_tp_rank(self) -> int:
        """The parameters one rank of a tensor-parallel group holds before any ZeRO sharding."""
        return self.num_params - self.split_num_params + -(-self.split_num_params // max(1, self.tensor_parallel))

    @property
    def params_per_rank(self) -> int:
        """The parameters one rank holds before any ZeRO sharding, whose gradients its data-parallel
        group reduces: on a pipeline, its heaviest stage's (split over the TP ranks where split)."""
        if not self.pipeline_stage_params:
            return self.params_per_tp_rank
        split = self.pipeline_stage_split_params or (0,) * len(self.pipeline_stage_params)
        tp = max(1, self.tensor_parallel)
        return max(held - part + -(-part // tp) for held, part in zip(self.pipeline_stage_params, split))

    def activation_bytes_per_sample_for(self, policy: str) -> int:
        """Bytes per sample held under an activation checkpointing policy: as the profile measured
        them, else (not measured: model_info, DeepSpeed's engine) as without checkpointing, which
        never under-counts."""
        return dict(self.activation_bytes_per_sample_by_policy).get(policy, self.activation_bytes_per_sample)

    def peak_fit(self, stage: int) -> PeakFit | None:
        family = engine_family(stage, self.engine)
        own = next((f for f in self.peak_fits if engine_family(f.zero_stage, self.engine) == family), None)
        if own is not None or self.engine != Engine.DEEPSPEED:
            return own
        # DeepSpeed's engine runs the same module in the same precision at every stage, so the
        # activations a fit measured at one stage hold at all (on an H200, a ZeRO-0 fit moved to
        # ZeRO-1 met 4 measured peaks within 0.1%, where the analytic activations were 20% short).
        # Ours differ: FSDP2 computes in pure bf16 where DDP runs under autocast.
        return next(iter(self.peak_fits), None)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak, by kind."""

    parameters: int
    gradients: int
    optimizer_states: int
    working_buffers: int  # DDP buckets, autocast weight copies, FSDP2 unsharded blocks
    activations: int
    baseline: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.working_buffers
                + self.activations + self.baseline)


@dataclass(frozen=True)
class StageSettings:
    zero_stage: int
    precision: str = "fp32"
    world_size: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    contiguous_gradients: bool = False
    gradient_accumulation_steps: int = 1
    zero_knobs: tuple[tuple[str, Any], ...] = ()  # zero_optimization as the experiment sets it (DeepSpeed's buckets)
    activation_policy: str = "none"  # activation_checkpointing.policy: what the blocks keep for backward


def model_state_bytes(profile: ModelProfile, settings: StageSettings) -> MemoryEstimate:
    """Everything except activations, for one rank."""
    p, w, stage = profile.params_per_tp_rank, max(1, settings.world_size), settings.zero_stage
    compute = COMPUTE_BYTES[settings.precision]
    if profile.engine == Engine.DEEPSPEED:
        parts = deepspeed_state_bytes(p, profile.optimizer_state_bytes_per_param, stage, compute, w,
                                      dict(settings.zero_knobs), settings.offload_optimizer, settings.offload_param)
        baseline = profile.baseline_bytes
        if stage == 3 and profile.sharded_baseline_bytes is not None:  # measured by the stage-3 profile launch
            baseline = profile.sharded_baseline_bytes
        return MemoryEstimate(*parts, 0, baseline)
    optimizer = int(profile.optimizer_state_bytes_per_param * p)
    if stage <= 1:
        parameters, gradients = BYTES_FP32 * p, BYTES_FP32 * p
        buffers = 0 if settings.contiguous_gradients else BYTES_FP32 * p
        if compute < BYTES_FP32:
            buffers += compute * p  # autocast's cached low-precision weights
        if stage == 1:
            optimizer //= w
    else:
        parameters, gradients, optimizer = BYTES_FP32 * p // w, BYTES_FP32 * p // w, optimizer // w
        if stage == 2:
            # Unsharded compute params persist forward->backward; one block's fp32 gradients in flight.
            buffers = compute * p + BYTES_FP32 * _block(profile)
        else:
            # The running block and the prefetched one, params and gradients.
            buffers = 2 * (compute + BYTES_FP32) * _block(profile)
        if settings.gradient_accumulation_steps > 1:
            # Without gradient sync FSDP2 accumulates unsharded gradients, in the compute dtype.
            buffers += compute * p
        if settings.offload_param or settings.offload_optimizer:
            parameters = gradients = optimizer = 0
    if settings.offload_optimizer:
        optimizer = 0
    baseline = profile.baseline_bytes
    if stage >= 2 and profile.sharded_baseline_bytes is not None:
        baseline = profile.sharded_baseline_bytes
    return MemoryEstimate(parameters, gradients, optimizer, buffers, 0, baseline)


def _block(profile: ModelProfile) -> int:
    """Parameters in one FSDP2 unit; the whole model when the block count is unknown."""
    if profile.num_shard_units > 0:
        return -(-profile.params_per_tp_rank // profile.num_shard_units)
    return profile.params_per_tp_rank


def estimate(profile: ModelProfile, settings: StageSettings, micro_batch_size: int) -> MemoryEstimate:
    if profile.pipeline_stage_params:  # a pipeline: its heaviest stage
        return max(stage_estimates(profile, settings, micro_batch_size, estimate), key=lambda e: e.total)
    states = model_state_bytes(profile, settings)
    fit = profile.peak_fit(settings.zero_stage)
    if fit is not None and fit.precision == settings.precision:
        return _fitted_estimate(profile, fit, settings, states, micro_batch_size)
    return MemoryEstimate(states.parameters, states.gradients, states.optimizer_states, states.working_buffers,
                          profile.activation_bytes_per_sample_for(settings.activation_policy) * micro_batch_size,
                          states.baseline)


def _fitted_estimate(profile: ModelProfile, fit: PeakFit, settings: StageSettings, states: MemoryEstimate,
                     micro_batch_size: int) -> MemoryEstimate:
    """The measured peaks of the profiled stage, moved to `settings` by what the analytic model says
    differs (optimizer sharding, offload, FSDP2's unsharded copies, gas buffers). Activations and
    everything the analytic sum gets wrong (gradients freed while activations live, optimizer
    temporaries, allocator rounding) come from the measurement. The baseline field carries the
    remainder, so the parts still add up to the total; it may be negative."""
    profiled = model_state_bytes(profile, replace(settings, zero_stage=fit.zero_stage,
                                                  gradient_accumulation_steps=fit.gradient_accumulation_steps,
                                                  offload_optimizer=False, offload_param=False))
    # Gradients are freed at every step (set_to_none) and grow in backward as activations are
    # freed, so the forward+backward peak holds none of them: they move the step's peak only.
    weights = lambda e: e.parameters + e.optimizer_states  # noqa: E731
    moved_weights = weights(states) - weights(profiled)
    moved_gradients = states.gradients - profiled.gradients
    moved_buffers = states.working_buffers - profiled.working_buffers
    # The fit was measured without checkpointing; a policy drops the saved bytes it does not keep,
    # and everything else in the measured slope (backward's temporaries) stays.
    dropped = profile.activation_bytes_per_sample - profile.activation_bytes_per_sample_for(settings.activation_policy)
    per_sample = max(fit.per_sample_bytes - dropped, profile.activation_bytes_per_sample_for(settings.activation_policy))
    forward_backward = fit.fixed_bytes + per_sample * micro_batch_size + moved_weights + moved_buffers
    if settings.zero_stage <= 1 and settings.gradient_accumulation_steps > 1:
        # set_to_none frees DDP's gradients at each step; with accumulation they live through the next forward.
        forward_backward += BYTES_FP32 * profile.params_per_tp_rank
    step = fit.optimizer_step_bytes + moved_weights + moved_gradients
    if settings.zero_stage <= 1:
        step += moved_buffers  # DDP's buckets live through the step; FSDP2 has resharded by then
    total = int(max(forward_backward, step))
    activations = int(per_sample * micro_batch_size)
    explained = weights(states) + states.gradients + states.working_buffers + activations
    return MemoryEstimate(states.parameters, states.gradients, states.optimizer_states, states.working_buffers,
                          activations, total - explained)


def engine_family(stage: int, engine: Engine = Engine.OURS) -> str:
    """Stages 0-1 run under DDP, 2-3 under FSDP2: each engine has its own unmodelled overhead.
    On DeepSpeed's engine: stage 0 is its plain data parallel, 1-2 DeepSpeedZeroOptimizer, 3 its
    Stage3 optimizer."""
    if engine == Engine.DEEPSPEED:
        return "DeepSpeed ZeRO-0" if stage == 0 else "DeepSpeed ZeRO-1/2" if stage <= 2 else "DeepSpeed ZeRO-3"
    return "DDP" if stage <= 1 else "FSDP2"


def engine_families(engine: Engine) -> tuple[str, ...]:
    return tuple(dict.fromkeys(engine_family(stage, engine) for stage in range(4)))


def usable_bytes(budget_bytes: int, safety_margin: float) -> int:
    """The part of the budget we plan to fill; the rest absorbs fragmentation and estimate error."""
    return int(budget_bytes * (1.0 - safety_margin))


def max_micro_batch_size(profile: ModelProfile, settings: StageSettings, budget_bytes: int,
                         safety_margin: float = 0.1) -> int:
    """Largest micro-batch whose estimate fits the budget; 0 when not even the model states fit."""
    room = usable_bytes(budget_bytes, safety_margin) - model_state_bytes(profile, settings).total
    if room <= 0:
        return 0
    if profile.activation_bytes_per_sample <= 0:
        return 2**31 - 1
    return int(room // profile.activation_bytes_per_sample)


def calibrate_baseline(profile: ModelProfile, settings: StageSettings, micro_batch_size: int,
                       measured_peak_bytes: int) -> int:
    """Process overhead implied by a measured peak: what the model does not explain (never negative)."""
    bare = replace(profile, baseline_bytes=0, sharded_baseline_bytes=0, peak_fits=())
    explained = estimate(bare, settings, micro_batch_size).total
    return max(0, measured_peak_bytes - explained)
