"""What a measurement launch does inside the engine: the tuner's request, the profile's model
info after step 1 (CPU) or 2 (CUDA), the metrics after the profile window, and the exit."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from autotuner.boundary import CollectiveTiming, MeasurementRequest, ModelInfo, request_from_env, write_record
from autotuner.config.models import DeepSpeedConfig
from autotuner.runtime.comm_probe import probe_collectives
from autotuner.runtime.memory_probes import optimizer_state_bytes
from autotuner.runtime.metrics import build_measurement, peak_memory_bytes, peak_reserved_bytes
from autotuner.runtime.profile import device_memory_bytes, write_model_info
from autotuner.runtime.sharding import shard_units
from autotuner.runtime.window_load import load_average


def measurement_request(config: DeepSpeedConfig) -> MeasurementRequest | None:
    """What this launch must measure: the tuner's request (a file the launcher named), else
    DeepSpeed's own keys in the user's autotuning section (metric_path, model_info_path)."""
    request = request_from_env()
    if request is not None:
        return request
    tuning = config.autotuning
    if not tuning.enabled or (tuning.metric_path is None and tuning.model_info_path is None):
        return None
    return MeasurementRequest(tuning.start_profile_step, tuning.end_profile_step, tuning.metric_path,
                              tuning.model_info_path, bool(tuning.model_info and tuning.model_info.profile),
                              tuning.metric_path)


class MeasurementHooks:
    """Mixed into Engine: reads its ctx, batch, window, probes and request."""

    _probe_after_window = False  # every rank: time the collectives once the window is measured
    _model_info: ModelInfo | None = None  # rank 0: what it wrote, for the probe's timings to join

    def _parameters_for_probe(self) -> list[torch.Tensor]:
        return list(self.wrapped.parameters())

    def _gather_max(self, value: int) -> list[int]:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.ctx.device)
        gathered = [torch.zeros_like(tensor) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, tensor)
        return [int(t.item()) for t in gathered]

    def _write_model_info(self) -> None:
        """After step 1 (CPU) or 2 (CUDA): parameters, activation bytes, optimizer-state bytes and
        peak memory, and on CUDA the peaks of forward+backward and of the optimizer step apart.
        A profile launch also times the collectives on the job's process group (comm_probe.py).

        When the request says so, every rank then leaves with status 0."""
        activation_per_rank = self._gather_max(self._activation_probe.bytes_saved)
        optimizer_per_rank = self._gather_max(optimizer_state_bytes(self._local_optimizer))
        # Stage 0 replicates the states on every rank; higher stages shard them across ranks.
        optimizer_bytes = optimizer_per_rank[0] if self.zero_stage == 0 else sum(optimizer_per_rank)
        peak = peak_memory_bytes(self.ctx.device)
        if self._phase_peaks is not None:
            peak = max(peak, self._phase_peaks.before_bytes, self._phase_peaks.forward_backward_bytes)
        peak_per_rank = self._gather_max(peak)
        reserved = peak_reserved_bytes(self.ctx.device)
        reserved_per_rank = self._gather_max(reserved) if reserved is not None else None
        phases = None
        if self._phase_peaks is not None:
            phases = (max(self._gather_max(self._phase_peaks.forward_backward_bytes)),
                      max(self._gather_max(self._phase_peaks.optimizer_step_bytes)))
        # The probe must not be in anything this launch measures: its buffers, and what gloo's
        # reduce-scatter and all-gather leave resident (measured: the window's CPU peak went from
        # 324 to 410-490 MiB per rank), would sit in the window's peak, and its half second in a
        # step's time. So it runs here, after the peaks
        # above, only when the ranks leave next; a launch that goes on to time its window runs it
        # once the window's figures are taken (_finish_profile), and a run that just trains, never.
        timings = self._probe() if self._request.exit_after_model_info else ()
        self._probe_after_window = not self._request.exit_after_model_info and self._exit_after_window
        if self.ctx.rank == 0:
            self._model_info = write_model_info(
                self._request.model_info_path,
                zero_stage_module=self.wrapped,
                activation_bytes_per_rank=activation_per_rank,
                optimizer_state_bytes=optimizer_bytes,
                micro_batch_size=self.batch.micro_batch_size,
                peak_memory_bytes_per_rank=peak_per_rank,
                peak_reserved_bytes_per_rank=reserved_per_rank,
                phase_peak_bytes=phases,
                num_shard_units=len(shard_units(self.wrapped, 0)),
                device_memory_bytes=device_memory_bytes(self.ctx.device),
                zero_stage=self.zero_stage,
                precision=self.precision,
                world_size=self.ctx.world_size,
                engines_in_process=self.created_in_process,
                backend=self.ctx.backend,
                collective_timings=timings,
            )
        if self._request.exit_after_model_info:
            self._leave()

    def _probe(self) -> tuple[CollectiveTiming, ...]:
        # The default group: the one DDP, ZeRO-1 and FSDP2 run on.
        return probe_collectives(self.ctx.device)

    def _leave(self) -> None:
        # os._exit, not sys.exit: interpreter teardown can deadlock freeing DDP's Reducer (gloo's
        # worker thread waits for the GIL the main thread holds while joining it), and a
        # measurement run has nothing left to clean up once the barrier shows every rank is done.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _finish_profile(self) -> None:
        """Rank 0 writes the metrics file; every rank then leaves with status 0."""
        self._write_measurement()
        if self.ctx.rank == 0:
            print(f"autotuner: profile steps done; metrics written to {self._request.metrics_path}", flush=True)
        if self._probe_after_window:
            self._add_collective_timings()
        self._leave()

    def _write_measurement(self) -> None:
        """Rank 0 writes the window's measurement so far (collective: every rank calls it)."""
        taken_by_others = self._window_watch.others_share()
        per_rank = self._gather_max(peak_memory_bytes(self.ctx.device))
        reserved = peak_reserved_bytes(self.ctx.device)
        reserved_per_rank = self._gather_max(reserved) if reserved is not None else None
        flops = self._flop_probe.total if self._flop_probe is not None else None
        if self.ctx.rank == 0:
            measurement = build_measurement(
                self._window,
                train_batch_size=self.batch.train_batch_size,
                world_size=self.ctx.world_size,
                micro_batch_size=self.batch.micro_batch_size,
                gradient_accumulation_steps=self.batch.gradient_accumulation_steps,
                zero_stage=self.zero_stage,
                precision=self.precision,
                peak_memory=max(per_rank),
                peak_memory_per_rank=per_rank,
                peak_reserved_per_rank=reserved_per_rank,
                flops_per_step=flops * self.batch.gradient_accumulation_steps if flops else None,
                device_type=self.ctx.device.type,
                cpu_taken_by_others=taken_by_others,
                load_average=load_average(),
            )
            write_record(self._request.metrics_path, measurement)

    def _add_collective_timings(self) -> None:
        """Once the window's figures are taken: time the collectives, and rank 0 adds them to
        the model info it wrote after the first step."""
        timings = self._probe()
        if self.ctx.rank == 0 and self._model_info is not None:
            self._model_info = dataclasses.replace(self._model_info, collective_timings=timings)
            write_record(self._request.model_info_path, self._model_info)
