"""A tuner's measurement launch of a pipeline: the shared protocol (runtime/measure/rank_measurement.py)
over train_batch() calls. One call is one optimizer step, so the profile window counts calls;
its wall time runs from the end of one call to the end of the next (the data read included), on
every rank alike, since a call returns only once the last stage's loss reached every stage. The
profile's activation bytes are those the first micro-batch saved on this rank's stage; the
per-stage figures (parameters held, activations) go in the model info, the heaviest stage's
peak decides the fit. Forward and backward interleave across micro-batches inside the schedule,
so they are not timed apart."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.core.boundary import MeasurementRequest
from autotuner.runtime.measure.measurement import PIPELINE_STAGES_KEY, STAGES_PER_RANK_KEY, BatchView, values_at
from autotuner.runtime.measure.memory_probes import mark_uncaught_oom, optimizer_state_bytes
from autotuner.runtime.measure.metrics import peak_memory_bytes
from autotuner.runtime.measure.profile import ActivationProbe, SplitRegions, sequence_length_of
from autotuner.runtime.measure.rank_measurement import RankMeasurement
from autotuner.runtime.measure.timers import ProfileWindow
from autotuner.runtime.measure.window_load import WindowWatch

def whole_model_counts(module: nn.Module, pipe_group: Any, device: torch.device) -> tuple[int, int]:
    """(all, trainable) parameters of the whole pipeline, each counted once: this stage's, less the
    copies of a tied weight beside its first holder's, summed over the pipe group (collective)."""
    total = trainable = 0
    for param in module.parameters():
        if getattr(param, "ds_pipe_replicated", False):
            continue
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    counts = torch.tensor([total, trainable], dtype=torch.int64, device=device)
    if dist.get_world_size(pipe_group) > 1:
        dist.all_reduce(counts, group=pipe_group)
    return int(counts[0]), int(counts[1])


class PipelineView(BatchView):
    """The protocol's view of the pipeline engine (runtime/pipeline/engine.py)."""

    name = "autotuner"
    engines_in_process = 1

    def __init__(self, engine: Any, probe: ActivationProbe | None, whole_counts: tuple[int, int],
                 tuned_over_script: tuple[str, ...]):
        self._engine = engine
        self._probe = probe
        self._whole_counts = whole_counts
        self.tuned_over_script = tuned_over_script

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def zero_stage(self) -> int:
        return self._engine.config.zero_optimization.stage

    @property
    def precision(self) -> str:
        return self._engine.config.precision

    def model(self) -> nn.Module:
        return self._engine.module

    def built_values(self, keys: list[str]) -> tuple[tuple[str, Any], ...]:
        """The config the engine trains with at the tuned keys; the stages as the module built them."""
        values = dict(values_at(self._engine.config.dump(by_alias=True), keys))
        if PIPELINE_STAGES_KEY in values:
            values[PIPELINE_STAGES_KEY] = self._engine.num_stages
        if STAGES_PER_RANK_KEY in values:
            values[STAGES_PER_RANK_KEY] = self._engine.module.stages_per_rank
        return tuple(values.items())

    def parameter_counts(self) -> tuple[int, int]:
        return self._whole_counts

    def num_shard_units(self) -> int:
        return 0

    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self._engine._local_optimizer)

    def tensor_parallel(self) -> tuple[int, int, int]:
        split = self._engine.split
        if split is None:
            return 1, 0, 0
        named = list(self._engine.module.named_parameters())
        split_count = sum(param.numel() for name, param in named if name in split.split_parameters)
        local = sum((param.to_local() if hasattr(param, "to_local") else param).numel()
                    for _, param in named if param.requires_grad)
        return self._engine.layout.tp_size, split_count, local

    def activation_bytes(self) -> int:
        return self._probe.bytes_saved if self._probe is not None else 0

    def activation_bytes_by_policy(self) -> dict[str, int]:
        return {}

    def splittable(self) -> SplitRegions:
        return SplitRegions()  # a pipeline's layouts are each profiled at their own degree

    def sequence_length(self) -> int:
        return self._probe.sequence_length if self._probe is not None else 0

    def flops_per_micro_step(self) -> None:
        return None

    def gradient_noise(self) -> None:
        return None

    def pipeline_position(self) -> tuple[int, int, str, int]:
        engine = self._engine
        return engine.stage_id, engine.num_stages, engine.config.pipeline.schedule, engine.module.stages_per_rank


class PipelineMeasurement:
    """What one pipeline engine measures in a tuner's launch (`request`), called around each
    train_batch()."""

    def __init__(self, engine: Any, request: MeasurementRequest, tuned_over_script: tuple[str, ...]):
        self.device = engine.device
        self.window = ProfileWindow(request.start_profile_step, request.end_profile_step, request.min_window_s,
                                    request.max_steps_per_window)
        self.exit_after_window = request.metrics_path is not None
        self.watch = WindowWatch(self.window, self.device, self.exit_after_window)
        self.wants_model_info = request.model_info_path is not None
        module = engine.module
        self.probe = ActivationProbe(list(module.parameters())) if self.wants_model_info else None
        counts = whole_model_counts(module, engine.pipe_group, self.device)  # (collective: at build, every rank)
        self.protocol = RankMeasurement(request, PipelineView(engine, self.probe, counts, tuned_over_script),
                                        self.window, self.watch, None)
        marker = request.oom_marker(dist.get_rank())
        if marker:
            mark_uncaught_oom(marker, dist.get_rank())
        self._last_end: float | None = None
        # What runs a forward on this rank: the module, or each of its virtual stages' chunks.
        runners = [module] if module.stages_per_rank == 1 else [stage.submod for stage in engine.pipeline_stages]
        self._hooks = {id(runner): [runner.register_forward_pre_hook(self._first_forward_starts),
                                    runner.register_forward_hook(self._first_forward_ends)]
                       for runner in runners} if self.probe is not None else {}

    # The first micro-batch's forward on this stage (each chunk's first, which is micro-batch 0's
    # there): what it saves for backward is the profile's, summed over the rank's chunks.
    def _first_forward_starts(self, module: nn.Module, args: tuple) -> None:
        if not self.probe.sequence_length:
            self.probe.sequence_length = sequence_length_of(list(args))
        self.probe.start()

    def _first_forward_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.probe.stop()
        for handle in self._hooks.pop(id(module), []):
            handle.remove()

    def batch_starts(self) -> None:
        if self._last_end is None:
            self.watch.note_steps_done(0)
            self.window.bytes_before_first_step = peak_memory_bytes(self.device)
            self._last_end = self._now()

    def batch_done(self, step: int, optimizer_step_s: float) -> None:
        now = self._now()
        wall, self._last_end = now - (self._last_end or now), now
        self.window.record_step(step, optimizer_step_s, wall)
        # Length 0 on every stage: only the first sees the inputs, and the ranks' rows must agree.
        self.window.record_peak(step, 0, peak_memory_bytes(self.device))
        self.watch.note_steps_done(step)
        if self.wants_model_info and step == 1:
            self.protocol.write_model_info()
        if self.exit_after_window and step == self.window.end_step:
            if self.watch.goes_on(step, self.protocol.write_measurement):
                self._last_end = self._now()  # agreeing and writing are not step time
            else:
                self.protocol.finish("autotuner: profile steps done")

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
