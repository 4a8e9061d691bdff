"""The measurement protocol inside a rank, one for both engines (ours and DeepSpeed's): after its
step the profile's model info, after the window the metrics, the collective probe outside any
window it would distort, and the exit. Each engine hands it a small view of itself (EngineView);
the records written and the order of the collectives are the same whichever engine trains."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.core.boundary import MeasurementRequest, ModelInfo, write_record
from autotuner.core.probe_records import CollectiveTiming, SplitLayerTiming
from autotuner.runtime.measure.comm_probe import probe_collectives, probe_subgroups, tensor_parallel_groups
from autotuner.runtime.measure.split_layer_probe import probe_split_layers
from autotuner.runtime.measure.leaving import leave_now
from autotuner.runtime.measure.memory_probes import PhasePeaks
from autotuner.runtime.measure.metrics import build_measurement, peak_memory_bytes, peak_reserved_bytes
from autotuner.runtime.measure.profile import SplitRegions, count_parameters, device_memory_bytes, write_model_info
from autotuner.runtime.measure.timers import ProfileWindow
from autotuner.runtime.measure.window_load import WindowWatch, load_average


class EngineView(Protocol):
    """What the protocol reads from an engine, at the moment it writes."""

    name: str  # "autotuner" or "deepspeed": recorded in the model info and the measurement
    device: torch.device
    rank: int
    world_size: int
    zero_stage: int
    precision: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    train_batch_size: int
    engines_in_process: int  # a GAN makes two; the profile sees the first
    tuned_over_script: tuple[str, ...]  # tuned keys laid over the script's own config values

    def model(self) -> nn.Module: ...

    def built_values(self, keys: list[str]) -> tuple[tuple[str, Any], ...]:
        """The engine's value at each tuned config key beyond the stage and batch triad (None: not set)."""

    def parameter_counts(self) -> tuple[int, int] | None:
        """(total, trainable) when the module's tensors do not say (ZeRO-3 partitions), else None."""

    def num_shard_units(self) -> int: ...

    def optimizer_state_bytes(self) -> int:
        """This rank's optimizer states."""

    def tensor_parallel(self) -> tuple[int, int, int]:
        """(the tensor-parallel degree, the parameters it split counted whole, the trainable elements
        this rank holds); (1, 0, 0) without tensor parallelism."""

    def activation_bytes(self) -> int:
        """Bytes the first micro-step saved for backward on this rank."""

    def splittable(self) -> SplitRegions:
        """At degree 1, what a tensor-parallel degree would split (the parameters its plan splits,
        counted whole; the bytes the first micro-step saved inside the plan's split regions on this
        rank; their share of its FLOPs). Empty where nothing would split or the engine does not say."""

    def activation_bytes_by_policy(self) -> dict[str, int]:
        """What each activation checkpointing policy would hold on this rank; empty if unknown."""

    def sequence_length(self) -> int:
        """Of the model's first input in the first micro-step; 0 if it has none or it was not seen."""

    def flops_per_micro_step(self) -> int | None: ...

    def gradient_noise(self) -> Any:
        """The gradient noise probe (runtime/measure/gradient_noise.py) where this engine has one, else None."""

    def pipeline_position(self) -> tuple[int, int, str, int] | None:
        """(this rank's stage, the stages, the schedule, the virtual stages per rank) on a pipeline
        engine, else None."""


class RankMeasurement:
    """One engine's measurement launch: what `request` asks, over `window`."""

    def __init__(self, request: MeasurementRequest, view: EngineView, window: ProfileWindow,
                 window_watch: WindowWatch, phase_peaks: PhasePeaks | None):
        self.request = request
        self.view = view
        self.window = window
        self.window_watch = window_watch
        self.phase_peaks = phase_peaks
        self.exit_after_window = request.metrics_path is not None
        self._probe_after_window = False  # every rank: time the collectives once the window is measured
        self._model_info: ModelInfo | None = None  # rank 0: what it wrote, for the probe's timings to join

    def gather_max(self, value: int) -> list[int]:
        """`value` from every rank, in rank order (collective)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [int(value)]
        tensor = torch.tensor([value], dtype=torch.int64, device=self.view.device)
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return [int(t.item()) for t in gathered]

    def _peaks(self) -> tuple[list[int], list[int] | None]:
        device = self.view.device
        peak = peak_memory_bytes(device)
        if self.phase_peaks is not None:
            peak = max(peak, self.phase_peaks.before_bytes, self.phase_peaks.forward_backward_bytes)
        reserved = peak_reserved_bytes(device)
        return self.gather_max(peak), (self.gather_max(reserved) if reserved is not None else None)

    def write_model_info(self) -> None:
        """After step 1 (CPU) or 2 (CUDA): parameters, activation bytes, optimizer-state bytes and
        peak memory, and on CUDA the peaks of forward+backward and of the optimizer step apart.
        A profile launch also times the collectives on the job's process group (comm_probe.py).

        When the request says so, every rank then leaves with status 0."""
        view = self.view
        activation_per_rank = self.gather_max(view.activation_bytes())
        by_policy = view.activation_bytes_by_policy()
        if len(set(self.gather_max(len(by_policy)))) > 1:  # every rank runs the same model: never, but no hang
            by_policy = {}
        by_policy = {policy: max(self.gather_max(size)) for policy, size in sorted(by_policy.items())}
        optimizer_per_rank = self.gather_max(view.optimizer_state_bytes())
        # Stage 0 replicates the states on every rank; higher stages shard them across ranks.
        optimizer_bytes = optimizer_per_rank[0] if view.zero_stage == 0 else sum(optimizer_per_rank)
        regions = view.splittable()
        split_bytes_per_rank = self.gather_max(regions.saved_bytes)
        tp, split_count, local_trainable = view.tensor_parallel()
        if tp > 1:  # a rank's state covers its shards: its bytes per element held, over the whole model
            held = self.gather_max(local_trainable)
            per_element = max(size / max(1, count) for size, count in zip(optimizer_per_rank, held))
            optimizer_bytes = int(per_element * count_parameters(view.model())[1])
        pipeline = self._pipeline_fields(activation_per_rank, optimizer_per_rank)
        if pipeline is not None:  # the states per parameter a stage holds, over the whole model's parameters
            whole = view.parameter_counts()
            optimizer_bytes = int(pipeline[1] * (whole[1] if whole else 0))
        peak_per_rank, reserved_per_rank = self._peaks()
        phases = None
        if self.phase_peaks is not None:
            phases = (max(self.gather_max(self.phase_peaks.forward_backward_bytes)),
                      max(self.gather_max(self.phase_peaks.optimizer_step_bytes)))
        # The probe must not be in anything this launch measures: its buffers, and what gloo's
        # reduce-scatter and all-gather leave resident (measured: the window's CPU peak went from
        # 324 to 410-490 MiB per rank), would sit in the window's peak, and its half second in a
        # step's time. So it runs here, after the peaks above, only when the ranks leave next; a
        # launch that goes on to time its window runs it once the window's figures are taken
        # (finish), and a run that just trains, never.
        timings, split_timings = self._probe() if self.request.exit_after_model_info else ((), ())
        self._probe_after_window = not self.request.exit_after_model_info and self.exit_after_window
        if view.rank == 0:
            self._model_info = write_model_info(
                self.request.model_info_path,
                zero_stage_module=view.model(),
                parameter_counts=view.parameter_counts(),
                activation_bytes_per_rank=activation_per_rank,
                optimizer_state_bytes=optimizer_bytes,
                micro_batch_size=view.micro_batch_size,
                peak_memory_bytes_per_rank=peak_per_rank,
                peak_reserved_bytes_per_rank=reserved_per_rank,
                phase_peak_bytes=phases,
                num_shard_units=view.num_shard_units(),
                device_memory_bytes=device_memory_bytes(view.device),
                zero_stage=view.zero_stage,
                precision=view.precision,
                world_size=view.world_size,
                engines_in_process=view.engines_in_process,
                backend=dist.get_backend() if dist.is_initialized() else None,
                collective_timings=timings,
                split_layer_timings=split_timings,
                engine=view.name,
                activation_bytes_by_policy=by_policy,
                sequence_length=view.sequence_length(),
                tensor_parallel=tp,
                split_num_params=split_count,
                splittable_num_params=regions.params,
                split_activation_bytes=max(split_bytes_per_rank, default=0),
                split_flop_share=regions.flop_share,
                split_row_layers=regions.row_layers,
                split_row_output_bytes=regions.row_output_bytes,
                split_col_layers=regions.col_layers,
                measured_model=model_class_name(view.model()),
                pipeline=pipeline[0] if pipeline is not None else None,
            )
        if self.request.exit_after_model_info:
            self.leave()

    def _pipeline_fields(self, activation_per_rank: list[int],
                         optimizer_per_rank: list[int]) -> tuple[dict[str, Any], float] | None:
        """On a pipeline (collective): ModelInfo's per-stage fields, and the optimizer-state bytes per
        parameter the heaviest-holding rank keeps (ZeRO 1 shards a stage's states over its replicas)."""
        position = self.view.pipeline_position()
        if position is None:
            return None
        stage, stages, schedule, per_rank = position
        stage_of_rank = self.gather_max(stage)
        held = self.gather_max(count_parameters(self.view.model())[1])
        tp, split, local = self.view.tensor_parallel()
        split_held = self.gather_max(split)
        # Under tensor parallelism a rank's states cover its shards: bytes per element it holds.
        elements = self.gather_max(local) if tp > 1 else held
        replicas = max(1, len(stage_of_rank) // stages // tp)
        shards = replicas if self.view.zero_stage == 1 else 1
        per_param = max(size * shards / max(1, count) for size, count in zip(optimizer_per_rank, elements))
        by_stage = range(stages)
        fields = {"pipeline_stages": stages, "pipeline_schedule": schedule, "pipeline_stages_per_rank": per_rank,
                  "stage_num_params": tuple(max(h for h, s in zip(held, stage_of_rank) if s == k) for k in by_stage),
                  "stage_split_num_params": tuple(max(h for h, s in zip(split_held, stage_of_rank) if s == k)
                                                  for k in by_stage),
                  "stage_activation_bytes": tuple(max(a for a, s in zip(activation_per_rank, stage_of_rank) if s == k)
                                                  for k in by_stage),
                  "stage_of_rank": tuple(stage_of_rank),
                  "pipeline_micro_batches": self.view.gradient_accumulation_steps}
        return fields, per_param

    def _probe(self) -> tuple[tuple[CollectiveTiming, ...], tuple[SplitLayerTiming, ...]]:
        # The default group: the one DDP, ZeRO-1, FSDP2 and DeepSpeed's engine run on; at degree 1,
        # where a tensor-parallel plan would split the model, its groups at each degree too, and
        # a split column and row layer on each (split_layer_probe.py).
        timings = probe_collectives(self.view.device)
        split_timings: tuple[SplitLayerTiming, ...] = ()
        if self.view.splittable().params > 0 and dist.get_world_size() > 1:
            groups = tensor_parallel_groups()
            timings += probe_subgroups(self.view.device, groups=groups)
            split_timings = probe_split_layers(self.view.device, groups)
        return timings, split_timings

    def write_measurement(self) -> None:
        """Rank 0 writes the window's measurement so far (collective: every rank calls it)."""
        view = self.view
        taken_by_others = self.window_watch.others_share()
        peak_per_rank, reserved_per_rank = self._peaks()
        flops = view.flops_per_micro_step()
        step_peaks = self._step_peaks()
        before_first_step = max(self.gather_max(self.window.bytes_before_first_step)) if step_peaks else None
        if view.rank == 0:
            measurement = build_measurement(
                self.window,
                train_batch_size=view.train_batch_size,
                world_size=view.world_size,
                micro_batch_size=view.micro_batch_size,
                gradient_accumulation_steps=view.gradient_accumulation_steps,
                zero_stage=view.zero_stage,
                precision=view.precision,
                peak_memory=max(peak_per_rank),
                peak_memory_per_rank=peak_per_rank,
                peak_reserved_per_rank=reserved_per_rank,
                flops_per_step=flops * view.gradient_accumulation_steps if flops else None,
                device_type=view.device.type,
                cpu_taken_by_others=taken_by_others,
                load_average=load_average(),
            )
            noise = view.gradient_noise()
            write_record(self.request.metrics_path, dataclasses.replace(
                measurement, engine=view.name, step_peaks=step_peaks,
                bytes_before_first_step=before_first_step,
                gradient_norms=tuple(noise.steps) if noise else (),
                gradient_noise_batches=tuple(noise.batches) if noise else (),
                built=view.built_values(list(self.request.tuned_values())),
                tuned_over_script=view.tuned_over_script))

    def _step_peaks(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per rank, per window step: (its longest input, the peak so far). Collective. Every rank
        holds the same steps (the window's end is agreed), so the rows line up."""
        lengths, peaks = self.window.step_lengths, self.window.step_peaks
        if not any(lengths):
            return ()
        local = torch.tensor([lengths, peaks], dtype=torch.int64, device=self.view.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        return tuple(tuple(zip(map(int, rows[0].tolist()), map(int, rows[1].tolist()))) for rows in gathered)

    def finish(self, done_line: str) -> None:
        """Rank 0 writes the metrics file; every rank then leaves with status 0."""
        self.write_measurement()
        if self.view.rank == 0:
            print(f"{done_line}; metrics written to {self.request.metrics_path}", flush=True)
        if self._probe_after_window:
            timings, split_timings = self._probe()
            if self.view.rank == 0 and self._model_info is not None:
                self._model_info = dataclasses.replace(self._model_info, collective_timings=timings,
                                                       split_layer_timings=split_timings)
                write_record(self.request.model_info_path, self._model_info)
        self.leave()

    def leave(self) -> None:
        # os._exit, not sys.exit: interpreter teardown can deadlock freeing DDP's Reducer (gloo's
        # worker thread waits for the GIL the main thread holds while joining it), and DeepSpeed's
        # teardown can hang on its threads; a measurement launch has nothing left to clean up
        # once the barrier shows every rank is done.
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        leave_now(0)


def model_class_name(model: Any) -> str:
    """The user's model class behind DDP's wrapper and FSDP2's generated `FSDP<Name>` class."""
    inner = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    for cls in type(inner).__mro__:
        if not cls.__name__.startswith("FSDP") and cls.__module__.split(".")[0] != "torch":
            return cls.__name__
    return type(inner).__name__
