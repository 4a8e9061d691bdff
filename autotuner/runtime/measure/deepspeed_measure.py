"""Measurement inside the ranks of a script that trains on DeepSpeed's own engine.

When a tuner's launch names a measurement request, each rank installs this before the user's
script runs. The moment `deepspeed` is imported, `DeepSpeedEngine.__init__`, `forward`,
`backward` and `step` are wrapped; the first engine the script creates is then measured exactly
as our own engine measures itself (runtime/measure/measurement.py):
- end-to-end time per optimizer step, from one accumulation boundary to the next, so the
  script's data loading is inside it; forward, backward and the boundary step apart;
- the peak per rank: the CUDA allocator's on GPU, the resident set's high-water mark on CPU;
- on a profile launch, the model's profile after the first step (the second on CUDA);
- an out-of-memory error inside any of them leaves the tuner's OOM marker.
After end_profile_step rank 0 writes the Measurement and every rank leaves with status 0.

DeepSpeed's own timers and its autotuning keys are not read: the experiment config carries no
`autotuning` section, so DeepSpeed never writes a metrics file of its own that could go stale.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable

from autotuner.core.boundary import MeasurementRequest

ENGINE_NAME = "deepspeed"


def install(request: MeasurementRequest) -> None:
    """Measure the first DeepSpeedEngine this process creates: now, if deepspeed is loaded
    already (a warm rank forked from a server that preloaded it), else when it is imported."""
    from autotuner.runtime.deepspeed_side import when_deepspeed_loads

    def patch() -> None:
        _patch(sys.modules["deepspeed.runtime.engine"].DeepSpeedEngine, request)

    when_deepspeed_loads(patch)


def _patch(engine_class: type, request: MeasurementRequest) -> None:
    if getattr(engine_class, "_autotuner_measured", False):
        return
    engines: list[Any] = []
    init = engine_class.__init__

    @functools.wraps(init)
    def measured_init(engine, *args, **kwargs):
        init(engine, *args, **kwargs)
        engines.append(engine)
        if len(engines) == 1:
            _unlink_shm_buffer(engine)
            engine.__dict__["_autotuner_measurement"] = DeepSpeedMeasurement(engine, request, engines)

    def timed(name: str):
        """The engine's method `name`, run through the measurement's method of that name on the
        measured engine, untouched on any other."""
        original = getattr(engine_class, name)

        @functools.wraps(original)
        def wrapper(engine, *args, **kwargs):
            measured = engine.__dict__.get("_autotuner_measurement")
            if measured is None:
                return original(engine, *args, **kwargs)
            return getattr(measured, name)(lambda: original(engine, *args, **kwargs))

        return wrapper

    engine_class.__init__ = measured_init
    for name in ("forward", "backward", "step"):
        setattr(engine_class, name, timed(name))
    engine_class._autotuner_measured = True


def _unlink_shm_buffer(engine: Any) -> None:
    import torch

    from autotuner.runtime.deepspeed_side import unlink_shm_buffer

    unlink_shm_buffer(torch.device(engine.device).type == "cpu")


class DeepSpeedView:
    """The measurement protocol's view of a DeepSpeedEngine (rank_measurement.py)."""

    name = ENGINE_NAME

    def __init__(self, engine: Any, engines: list[Any], activation_bytes: Callable[[], int],
                 activation_bytes_by_policy: Callable[[], dict[str, int]] = dict,
                 sequence_length: Callable[[], int] = int):
        import torch

        self._engine = engine
        self._engines = engines
        self._activation_bytes = activation_bytes
        self._activation_bytes_by_policy = activation_bytes_by_policy
        self._sequence_length = sequence_length
        self.device = torch.device(engine.device)
        self.rank = int(engine.global_rank)

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def zero_stage(self) -> int:
        return int(self._engine.zero_optimization_stage())

    @property
    def precision(self) -> str:
        if self._engine.bfloat16_enabled():
            return "bf16"
        return "fp16" if self._engine.fp16_enabled() else "fp32"

    @property
    def micro_batch_size(self) -> int:
        return int(self._engine.train_micro_batch_size_per_gpu())

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self._engine.gradient_accumulation_steps())

    @property
    def train_batch_size(self) -> int:
        return int(self._engine.train_batch_size())

    @property
    def engines_in_process(self) -> int:
        return len(self._engines)

    def model(self) -> Any:
        return self._engine.module

    tuned_over_script: tuple[str, ...] = ()  # DeepSpeed trains with what it is given: checked, never laid over

    def built_values(self, keys: list[str]) -> tuple[tuple[str, Any], ...]:
        """The config DeepSpeed's engine was given (a file's or the script's own dict), at the tuned keys."""
        from autotuner.runtime.measure.measurement import values_at

        given = getattr(getattr(self._engine, "_config", None), "_param_dict", None)
        return values_at(given if isinstance(given, dict) else {}, keys)

    def parameter_counts(self) -> tuple[int, int]:
        """Whole-model counts: under ZeRO-3 a parameter's tensor is empty and `ds_numel` its size."""
        total = trainable = 0
        for param in self._engine.module.parameters():
            numel = int(getattr(param, "ds_numel", param.numel()))
            total += numel
            trainable += numel if param.requires_grad else 0
        return total, trainable

    def num_shard_units(self) -> int:
        return 0  # DeepSpeed partitions parameters, not FSDP2 blocks

    def tensor_parallel(self) -> tuple[int, int, int]:
        return 1, 0, 0  # the tuner refuses a tensor-parallel tune on DeepSpeed's engine (app/settle.py)

    def optimizer_state_bytes(self) -> int:
        """This rank's optimizer states: those of the torch optimizer inside DeepSpeed's wrappers
        (under ZeRO its parameters are this rank's fp32 partitions)."""
        import torch

        from autotuner.runtime.measure.memory_probes import optimizer_state_bytes

        optimizer = self._engine.optimizer
        for _ in range(4):
            if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
                break
            optimizer = getattr(optimizer, "optimizer", None)
        return optimizer_state_bytes(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else 0

    def activation_bytes(self) -> int:
        return self._activation_bytes()

    def activation_bytes_by_policy(self) -> dict[str, int]:
        """What each policy would hold, from the profile's forward of the engine's module: the
        script checkpoints (Hugging Face's --gradient_checkpointing, mapped to the policy), but
        its repeated blocks are found as our engine finds them."""
        return self._activation_bytes_by_policy()

    def sequence_length(self) -> int:
        return self._sequence_length()

    def splittable(self):
        from autotuner.runtime.measure.profile import SplitRegions

        return SplitRegions()  # the tuner refuses a tensor-parallel tune on DeepSpeed's engine (app/settle.py)

    noise = None  # a goodput launch's DeepSpeedNoiseProbe, where DeepSpeed reduces at the boundary (ZeRO 0)

    def gradient_noise(self):
        return self.noise

    def pipeline_position(self) -> None:
        return None  # DeepSpeed's own PipelineEngine is not measured (a pipeline tune runs on ours)

    def flops_per_micro_step(self) -> None:
        return None  # not counted inside DeepSpeed's engine


class DeepSpeedMeasurement:
    """The profile window of one DeepSpeedEngine, timed from outside it; what is written, and
    when the ranks leave, is the shared protocol's (rank_measurement.py)."""

    def __init__(self, engine: Any, request: MeasurementRequest, engines: list[Any]):
        from autotuner.runtime.measure.memory_probes import PhasePeaks, mark_uncaught_oom
        from autotuner.runtime.measure.rank_measurement import RankMeasurement
        from autotuner.runtime.measure.timers import ProfileWindow, Stopwatch
        from autotuner.runtime.measure.window_load import WindowWatch

        self.engine = engine
        self.request = request
        self.view = DeepSpeedView(engine, engines, self._activation_bytes, self._activation_bytes_by_policy,
                                  lambda: self.activation_probe.sequence_length if self.activation_probe else 0)
        self.device = self.view.device
        self.rank = self.view.rank
        self.window = ProfileWindow(request.start_profile_step, request.end_profile_step, request.min_window_s,
                                    request.max_steps_per_window)

        self.watch = Stopwatch(self.device)
        self.last_boundary_end: float | None = None
        self.pending_forward_s = 0.0
        want_info = request.model_info_path is not None
        self.activation_probe = None
        self.want_info = want_info
        # As our engine: on CUDA the profile is taken at step 2 (optimizer states allocated), phases apart.
        self.phase_peaks = PhasePeaks() if want_info and self.device.type == "cuda" else None
        self.info_step = 2 if self.phase_peaks is not None else 1
        self.exit_after_window = request.metrics_path is not None
        self.watch_window = WindowWatch(self.window, self.device, self.exit_after_window)
        self.protocol = RankMeasurement(request, self.view, self.window, self.watch_window, self.phase_peaks)
        if request.gradient_noise:
            from autotuner.runtime.measure.gradient_noise import DeepSpeedNoiseProbe

            if DeepSpeedNoiseProbe.unusable(engine) is None:
                self.view.noise = DeepSpeedNoiseProbe(engine)
        self.oom_marker = request.oom_marker(self.rank)
        if self.oom_marker:
            mark_uncaught_oom(self.oom_marker, self.rank)

    def _activation_bytes(self) -> int:
        return self.activation_probe.bytes_saved if self.activation_probe is not None else 0

    def _activation_bytes_by_policy(self) -> dict[str, int]:
        return self.activation_probe.bytes_by_policy() if self.activation_probe is not None else {}

    # ----- the wrapped calls -----
    def forward(self, call):
        if self.last_boundary_end is None:
            self.watch_window.note_steps_done(0)
            self.last_boundary_end = self.watch.now()
        first_micro_step = self.want_info and self.engine.micro_steps == 0
        if first_micro_step:
            self._start_activation_probe()
        started = self.watch.now()
        with self._oom_guard():
            output = call()
        self.pending_forward_s = self.watch.now() - started
        if first_micro_step and self.activation_probe is not None:
            self.activation_probe.stop()
        return output

    def backward(self, call):
        started = self.watch.now()
        with self._oom_guard():
            result = call()
        self.window.record_micro(self.engine.global_steps + 1, self.pending_forward_s, self.watch.now() - started)
        return result

    def step(self, call):
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        if not boundary:
            with self._oom_guard():
                return call()
        next_step = self.engine.global_steps + 1
        measure_phases = self.phase_peaks is not None and next_step == self.info_step
        if measure_phases:
            self.phase_peaks.end_forward_backward(self.device)
        started = self.watch.now()
        with self._oom_guard():
            result = call()
        now = self.watch.now()
        step_s = now - started
        if measure_phases:
            self.phase_peaks.end_optimizer_step(self.device)
        elif self.phase_peaks is not None and next_step + 1 == self.info_step:
            self.phase_peaks.start(self.device)
        wall = now - (self.last_boundary_end if self.last_boundary_end is not None else now)
        self.last_boundary_end = now
        steps = int(self.engine.global_steps)
        self.window.record_step(steps, step_s, wall)
        self.watch_window.note_steps_done(steps)
        if self.want_info and steps == self.info_step:
            self.protocol.write_model_info()
        if self.exit_after_window and steps == self.window.end_step:
            if self.watch_window.goes_on(steps, self.protocol.write_measurement):
                self.last_boundary_end = self.watch.now()  # agreeing and writing are not step time
            else:
                self.protocol.finish("autotuner: profile steps done on DeepSpeed's engine")
        return result

    # ----- the first micro-step's saved activations -----
    def _start_activation_probe(self) -> None:
        from autotuner.runtime.measure.profile import ActivationProbe
        from autotuner.runtime.training.activation_checkpointing import repeated_blocks

        self.activation_probe = ActivationProbe(list(self.engine.module.parameters()), repeated_blocks(self.engine.module),
                                                model=self.engine.module)
        self.activation_probe.start()

    @contextlib.contextmanager
    def _oom_guard(self):
        from autotuner.runtime.measure.memory_probes import write_oom_marker
        from autotuner.runtime.measure.metrics import is_out_of_memory

        try:
            yield
        except (MemoryError, RuntimeError) as err:
            if self.oom_marker and (isinstance(err, MemoryError) or is_out_of_memory(err)):
                write_oom_marker(self.oom_marker, self.rank, err)
            raise
