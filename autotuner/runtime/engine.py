"""The training engine: DeepSpeed's forward / backward / step contract over a wrapped model."""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from autotuner.config.batch import BatchSizes
from autotuner.config.models import DeepSpeedConfig
from autotuner.runtime.distributed import DistributedContext
from autotuner.runtime.measure.gradient_noise import GradientNoiseProbe, MicroStepNoiseProbe
from autotuner.runtime.measure.measurement import OurEngineView, measurement_request
from autotuner.runtime.measure.memory_probes import PhasePeaks, mark_uncaught_oom, write_oom_marker
from autotuner.runtime.measure.metrics import is_out_of_memory, peak_memory_bytes
from autotuner.runtime.measure.profile import ActivationProbe, FlopProbe, sequence_length_of
from autotuner.runtime.measure.rank_measurement import RankMeasurement
from autotuner.runtime.measure.timers import ProfileWindow, Stopwatch
from autotuner.runtime.measure.window_load import WindowWatch
from autotuner.runtime.online import start_online
from autotuner.runtime.online.apply import apply_fsdp_prefetch, fsdp_prefetch_depths, fsdp_units, read_applied, rewrap_ddp
from autotuner.runtime.progress.reporting import RunReporter
from autotuner.runtime.saving.engine_checkpoints import EngineCheckpoints
from autotuner.runtime.saving.rank_zero_gather import StepGate
from autotuner.runtime.training.accessors import DeepSpeedAccessors
from autotuner.runtime.training.optimizer_step import OptimizerStep
from autotuner.runtime.training.activation_checkpointing import repeated_blocks
from autotuner.runtime.training.grad_reduction import GradientReduction
from autotuner.core.errors import UnsupportedError
from autotuner.runtime.training.method_calls import MethodCalls
from autotuner.runtime.training.overflow import attach_overflow_record
from autotuner.runtime.training.sharding import average_gradients, unwrap, wrap_ddp
from autotuner.runtime.training.batch_ramp import BatchRamp, ramp_after_step
from autotuner.runtime.training.split_zero import SplitShadows
from autotuner.runtime.training.tp_plan import plan_styles
from autotuner.runtime.training.tensor_parallel import (ParallelLayout, SplitModel, check_same_batch,
                                                         data_parallel_layout)

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Engine(DeepSpeedAccessors, EngineCheckpoints, OptimizerStep, nn.Module):
    """Returned by `autotuner.initialize`. Call it for forward, then `backward(loss)` and `step()`
    on every micro-batch; the optimizer steps only at the gradient-accumulation boundary. Built
    without an optimizer (DeepSpeed-Chat's reference and reward models) it runs forward only."""

    created_in_process = 0  # a GAN makes two, DeepSpeed-Chat's step 3 four
    training_engines_in_process = 0  # with an optimizer: the first is the one a tuner measures

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        config: DeepSpeedConfig,
        batch: BatchSizes,
        ctx: DistributedContext,
        local_optimizer: torch.optim.Optimizer,
        grad_scaler: Any = None,
        training_dataloader: Any = None,
        client_optimizer: bool = False,
        gradient_noise: GradientNoiseProbe | MicroStepNoiseProbe | None = None,
        layout: ParallelLayout | None = None,
        split: SplitModel | None = None,
        shadows: SplitShadows | None = None,
        ramp: BatchRamp | None = None,
        measured: bool = True,
    ):
        super().__init__()
        Engine.created_in_process += 1
        Engine.training_engines_in_process += int(optimizer is not None)
        self.measured = measured  # the engine a tuner's launch measures (script_config._measured_here)
        self.wrapped = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.batch = batch
        self.ctx = ctx
        self.layout = layout or data_parallel_layout(ctx)
        self._split = split  # what tensor parallelism split (None: every rank holds the whole model)
        self._shadows = shadows  # ZeRO 1 under tensor parallelism: what its optimizer steps (split_zero.py)
        self._batch_checked = split is None  # a TP group's ranks compare their first batch
        self.training_dataloader = training_dataloader
        self.zero_stage = int(config.zero_optimization.stage)
        self.precision = config.precision
        self.global_steps = 0
        self.micro_steps = 0
        self._boundary_base = 0  # micro-steps before the batch last changed: accumulation counts from there
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: torch.Tensor | None = None  # a tensor: reading it would sync the GPU each step
        self._step_applied = False
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's
        self.tuned_over_script: tuple[str, ...] = ()  # tuned keys laid over the script's own config (initialize)
        self._client_optimizer = client_optimizer
        self._local_optimizer = local_optimizer  # what DCP checkpoints: this rank's (partition of the) optimizer
        self._grad_scaler = grad_scaler
        self._fsdp = self.zero_stage >= 2
        # Gradient reduction must not depend on how forward was called: DDP reduces only after its
        # own forward, and stalls on parameters that get no gradient. Counted per accumulation window.
        self._engine_forwards = 0
        self._manually_averaged = False  # this step's gradients were averaged by us, not all by DDP
        self._find_unused_parameters = False
        self._noise = gradient_noise  # a tuner's launch at ZeRO 0/1 (or the batch ramp's): the gradient noise's figures
        self._ramp = ramp  # autotuning.adapt_batch in the training run (training/batch_ramp.py)
        self._autocast = self.precision in _AUTOCAST_DTYPES and not self._fsdp
        request = measurement_request(config) if measured else None
        self._request = request
        if optimizer is not None:
            attach_overflow_record(optimizer, self)
        self._window = ProfileWindow(request.start_profile_step, request.end_profile_step, request.min_window_s,
                                     request.max_steps_per_window) if request else \
            ProfileWindow(config.autotuning.start_profile_step, config.autotuning.end_profile_step)
        self._exit_after_window = request is not None and request.metrics_path is not None
        self._window_watch = WindowWatch(self._window, ctx.device, self._exit_after_window)
        self._forward_watch = Stopwatch(ctx.device)
        self._backward_watch = Stopwatch(ctx.device)
        self._step_watch = Stopwatch(ctx.device)
        self._pending_forward_s = 0.0
        self._step_length = 0  # the longest input of this optimizer step's micro-steps so far
        self._last_boundary_end: float | None = None
        # FLOPs are counted on the first micro-step, which lies before the profile window.
        count_flops = self._exit_after_window and self._window.start_step > 1
        self._flop_probe = FlopProbe() if count_flops else None
        want_model_info = request is not None and request.model_info_path is not None
        # The blocks let the probe say what each checkpointing policy would hold (the tuner's memory term).
        self._activation_probe = ActivationProbe(list(self.wrapped.parameters()), repeated_blocks(unwrap(self.wrapped)),
                                                 model=self.wrapped) if want_model_info else None
        if self._activation_probe is not None and split is None:  # what a tensor-parallel degree would split
            self._activation_probe.watch_split_regions(unwrap(self.wrapped), plan_styles(unwrap(self.wrapped)))
        # On CUDA the profile reads the allocator's peaks of step 2 apart for forward+backward and for
        # the optimizer step: the steady state, with optimizer states allocated. The CPU's resident
        # set cannot be split by phase, so there the profile stays at step 1.
        self._phase_peaks = PhasePeaks() if want_model_info and ctx.device.type == "cuda" else None
        self._model_info_step = 2 if self._phase_peaks is not None else 1
        self._measurement = RankMeasurement(request, OurEngineView(self), self._window, self._window_watch,
                                            self._phase_peaks) if request is not None else None
        self._oom_marker = request.oom_marker(ctx.rank) if request is not None else None
        if self._oom_marker:
            mark_uncaught_oom(self._oom_marker, ctx.rank)
        self._ddp_knobs: dict[str, Any] = {}  # online-tuned DDP knobs, kept when DDP is wrapped again
        self._reshard_after_backward = True  # FSDP2, between accumulation micro-steps
        self._reshard_after_backward_set = True
        self._online = start_online(self, len(fsdp_units(self.wrapped)) if self._fsdp else 0)
        self.reporter = RunReporter(self)  # monitors, tput_timer, wall-clock timers, flops profiler
        self.step_gate = StepGate()
        # A model method a script calls through the engine runs as the engine's forward would (method_calls.py).
        self._method_calls = MethodCalls(unwrap(self.wrapped), _AUTOCAST_DTYPES[self.precision] if self._autocast
                                         else None, ctx.device, self._before_method_call)

    def _before_method_call(self) -> None:
        if self._fsdp and self.optimizer is not None:
            self._set_gradient_sync(self.is_gradient_accumulation_boundary())

    def _through_engine(self, name: str, value: Any) -> Any:
        """A bound method of the user's model, reached through the engine's attribute pass-through:
        run in the forward's context (method_calls.py); anything else as it is."""
        calls = self.__dict__.get("_method_calls")  # (set last in __init__)
        if (calls is not None and calls.needed and inspect.ismethod(value) and value.__self__ is unwrap(self.wrapped)
                and name != "forward" and not hasattr(nn.Module, name)):
            return calls.wrap(value)
        return value

    # ----- training -----
    def _set_gradient_sync(self, sync: bool) -> None:
        # Must be set before forward: DDP decides at forward time whether backward all-reduces.
        if self._fsdp:
            self.wrapped.set_requires_gradient_sync(sync)
            # The last micro-step always reshards: the optimizer updates the shards, and
            # unsharded copies kept past it would be stale at the next forward.
            reshard = sync or self._reshard_after_backward
            if reshard != self._reshard_after_backward_set:
                self.wrapped.set_reshard_after_backward(reshard)
                self._reshard_after_backward_set = reshard
        elif isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.require_backward_grad_sync = sync

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._last_boundary_end is None:
            self._window_watch.note_steps_done(0)
            self._last_boundary_end = self._forward_watch.now()
        if not self._batch_checked:
            check_same_batch(self.layout, inputs, kwargs)
            self._batch_checked = True
        sync = self.is_gradient_accumulation_boundary()
        # Only a forward with the sync on makes DDP reduce: earlier micro-steps' forwards through
        # the engine do not, when the boundary's went through the raw module.
        self._engine_forwards += int(sync)
        self._set_gradient_sync(sync)
        if self._measurement is not None:
            self._step_length = max(self._step_length, sequence_length_of([*inputs, *kwargs.values()]))
            if self.micro_steps == 0:
                self._window.bytes_before_first_step = peak_memory_bytes(self.ctx.device)
        if self._flop_probe is not None and self.micro_steps == 0:
            self._flop_probe.start()
        if self._activation_probe is not None and self.micro_steps == 0:
            self._activation_probe.start()
        autocast = (
            torch.autocast(self.ctx.device.type, dtype=_AUTOCAST_DTYPES[self.precision])
            if self._autocast
            else contextlib.nullcontext()
        )
        self.reporter.forward_started(self.global_steps, self._micro_in_step() == 0)
        self._forward_watch.start()
        with autocast, self._oom_guard():
            output = self.wrapped(*inputs, **kwargs)
        self._pending_forward_s = self._forward_watch.stop()
        self.reporter.forward_done(self._pending_forward_s)
        if self._activation_probe is not None and self.micro_steps == 0:
            self._activation_probe.stop()
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of loss / gas (of loss itself with `scale_wrt_gas=False`, as in DeepSpeed);
        gradients are synchronised only at the accumulation boundary. Returns the loss as scaled
        for accumulation, as DeepSpeed's engine does."""
        if self.optimizer is None:
            raise _forward_only("backward")
        gas = self.batch.gradient_accumulation_steps
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        gas_scaled = scaled
        if self._grad_scaler is not None:
            scaled = self._grad_scaler.scale(scaled)
        self._backward_watch.start()
        with self._oom_guard():
            scaled.backward(retain_graph=retain_graph)
        backward_s = self._backward_watch.stop()
        if self._flop_probe is not None and self.micro_steps == 0:
            self._flop_probe.stop()
        self._window.record_micro(self.global_steps + 1, self._pending_forward_s, backward_s)
        self.reporter.backward_done(loss, backward_s)
        return gas_scaled

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Call on every micro-batch. At the boundary: clip, optimizer step, zero grad, scheduler step
        (with `lr_kwargs` as keywords, as DeepSpeed passes them)."""
        if self.optimizer is None:
            raise _forward_only("step")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._step_applied = False
        if self._fsdp:
            # Set for the next micro-step now: a forward through the raw module (FSDP2's hooks are on
            # it) then reduces at the boundary too, where only the engine's forward used to set it.
            self._set_gradient_sync(self.is_gradient_accumulation_boundary())
        if not boundary:
            self.reporter.step_done(0.0, boundary=False)
            return
        measure_phases = self._phase_peaks is not None and self.global_steps + 1 == self._model_info_step
        if measure_phases:
            self._phase_peaks.end_forward_backward(self.ctx.device)
        rewrap = self._reduce_what_ddp_missed()
        if self._split is not None and not self._fsdp and self.layout.dp_size > 1:
            # Stages 0-1 under tensor parallelism: no DDP; the data-parallel replicas average here.
            average_gradients([p for p in self.wrapped.parameters() if p.requires_grad], self.layout.dp_size,
                              self.layout.dp_group, GradientReduction.from_config(self.config))
        if self._shadows is not None:
            self._shadows.hand_gradients()
        if self._noise is not None:
            self._noise.step_done(self.global_steps + 1, whole=not self._manually_averaged)
        self.step_gate.enter_step()  # another thread reading the shards waits for the update to finish
        self._step_watch.start()
        with self._oom_guard():
            self._optimizer_step(lr_kwargs)
        if rewrap:
            self._rewrap_for_unused_parameters()
        step_s = self._step_watch.stop()
        if measure_phases:
            self._phase_peaks.end_optimizer_step(self.ctx.device)
        elif self._phase_peaks is not None and self.global_steps + 2 == self._model_info_step:
            self._phase_peaks.start(self.ctx.device)
        now = self._step_watch.now()
        wall = now - (self._last_boundary_end or now)
        self._last_boundary_end = now
        self.global_steps += 1
        self.global_samples += self.batch.train_batch_size
        self.step_gate.leave_step(self.global_steps)
        self._window.record_step(self.global_steps, step_s, wall)
        if self._measurement is not None:
            self._window.record_peak(self.global_steps, self._step_length, peak_memory_bytes(self.ctx.device))
        self._step_length = 0
        self._window_watch.note_steps_done(self.global_steps)
        self.reporter.step_done(step_s, boundary=True)
        if self._ramp is not None:
            ramp_after_step(self)
        if self._online is not None:
            self._online.after_step(self.global_steps, now)
        if self._activation_probe is not None and self.global_steps == self._model_info_step:
            self._measurement.write_model_info()
        if self._exit_after_window and self.global_steps == self._window.end_step:
            if self._window_watch.goes_on(self.global_steps, self._measurement.write_measurement):
                self._last_boundary_end = self._step_watch.now()  # agreeing and writing are not step time
            else:
                self._measurement.finish("autotuner: profile steps done")

    def _reduce_what_ddp_missed(self) -> bool:
        """ZeRO 0/1 at the accumulation boundary. DDP leaves gradients unreduced when the boundary
        micro-step's forward ran on the raw module (a GAN calling netD(x)), and leaves its buckets unfinished when a
        parameter got no gradient (an unused pooler), which it then raises about at the next
        forward. One small all-reduce per step finds either case on any rank; we then average
        the gradients ourselves. Returns whether DDP must track unused parameters from now on."""
        forwards, self._engine_forwards = self._engine_forwards, 0
        if self._fsdp or not isinstance(self.wrapped, DistributedDataParallel) or self.ctx.world_size == 1:
            return False
        trainable = [p for p in self.wrapped.parameters() if p.requires_grad]
        missing = not self._find_unused_parameters and any(p.grad is None for p in trainable)
        flags = torch.tensor([float(forwards == 0), float(missing)], device=self.ctx.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        raw_forward, unused = (bool(v) for v in flags.tolist())
        self._manually_averaged = raw_forward or unused
        if raw_forward or unused:
            average_gradients(trainable, self.ctx.world_size)
        return unused

    def _rewrap_for_unused_parameters(self) -> None:
        """Wrap the model again with find_unused_parameters=True, between steps (no gradient in
        flight); the parameters, and so the optimizer, stay the same objects."""
        if self.ctx.rank == 0:
            logger.warning("some parameters got no gradient this step; DDP now tracks unused parameters "
                           "(find_unused_parameters=True), as DeepSpeed tolerates them")
        self._find_unused_parameters = True
        self.wrapped = rewrap_ddp(self.wrapped, lambda module: wrap_ddp(
            module, self.config.zero_optimization, self.ctx, find_unused_parameters=True, knobs=self._ddp_knobs,
            reduction=GradientReduction.from_config(self.config), noise=self._noise))

    # ----- communication knobs (online tuning; between steps only) -----
    def apply_knobs(self, knobs: dict[str, Any]) -> None:
        """Set communication knobs. DDP's are fixed at construction, so DDP is wrapped again around
        the same parameters; FSDP2's prefetch lists and resharding are set in place."""
        if self._fsdp:
            forward, backward = fsdp_prefetch_depths(self.wrapped)
            apply_fsdp_prefetch(self.wrapped, int(knobs.get("forward_prefetch", forward)),
                                int(knobs.get("backward_prefetch", backward)))
            self._reshard_after_backward = bool(knobs.get("reshard_after_backward", self._reshard_after_backward))
            return
        wanted = {k: knobs[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view") if k in knobs}
        if not isinstance(self.wrapped, DistributedDataParallel) or not wanted:
            return
        if {k: self.applied_knobs()[k] for k in wanted} == wanted:
            return
        self._ddp_knobs = wanted
        self.wrapped = rewrap_ddp(self.wrapped, lambda module: wrap_ddp(
            module, self.config.zero_optimization, self.ctx, find_unused_parameters=self._find_unused_parameters,
            knobs=self._ddp_knobs, reduction=GradientReduction.from_config(self.config), noise=self._noise))

    def applied_knobs(self) -> dict[str, Any]:
        """The knobs in effect, read from the wrapper."""
        return read_applied(self.wrapped, self._reshard_after_backward)

    @contextlib.contextmanager
    def _oom_guard(self):
        """When tuning, leave a marker beside the metrics file on out-of-memory, so the tuner
        records OOM from a file rather than by reading logs. The error still propagates."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if self._oom_marker and is_out_of_memory(err):
                write_oom_marker(self._oom_marker, self.ctx.rank, err)
            raise


def _forward_only(call: str) -> UnsupportedError:
    return UnsupportedError(f"engine.{call}: this engine was built without an optimizer (initialize(model=..., "
                            "config=...) with no optimizer=... and no 'optimizer' section), so it runs forward only, "
                            "as DeepSpeed's does; pass an optimizer to initialize to train it")
