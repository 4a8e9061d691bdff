"""What a training run reports as it goes, as DeepSpeed's engine reports it: monitor events,
engine.tput_timer, wall_clock_breakdown timers, the flops profiler and the progress line.

The Engine calls forward_started / forward_done / backward_done / step_done; everything printed or
written comes from rank 0. Events at each optimizer step, x = samples trained (DeepSpeed's):
Train/Samples/train_loss (the mean loss of the accumulation window; DeepSpeed 0.19 writes it only
from its pipeline engine, earlier releases from every engine), Train/Samples/lr,
Train/Samples/loss_scale (fp16), and with wall_clock_breakdown Train/Samples/elapsed_time_ms_*.
"""

from __future__ import annotations

from typing import Any

import torch

from autotuner.runtime.progress.monitor import MonitorMaster
from autotuner.runtime.progress.throughput import ThroughputTimer
from autotuner.runtime.progress.wall_clock import WallClockBreakdown


def rank0_printer(rank: int):
    def emit(message: str) -> None:
        if rank == 0:
            print(f"[Rank 0] {message}", flush=True)
    return emit


class RunReporter:
    def __init__(self, engine: Any):
        config, rank = engine.config, engine.ctx.rank
        # A tuning experiment is a few measured steps of many: its curves would be mixed into the
        # user's job folders, so monitors, profiles and timer lines wait for the real run.
        measuring = engine._request is not None
        self._engine = engine
        self._rank = rank
        self._print = rank0_printer(rank)
        self.monitor = MonitorMaster(config, active=not measuring)
        self.tput_timer = ThroughputTimer(config.timers.throughput, batch_size=engine.batch.train_batch_size,
                                          steps_per_output=config.steps_per_print, device=engine.ctx.device,
                                          logging_fn=self._print)
        self.wall_clock = WallClockBreakdown(rank) if config.wall_clock_breakdown and not measuring else None
        profile_here = config.flops_profiler.enabled and rank == 0 and not measuring
        self._profile = config.flops_profiler if profile_here else None
        self.flops_profiler = None
        self._profiling = False
        self._window_losses: list[torch.Tensor] = []

    # ----- called by the Engine -----
    def forward_started(self, global_steps: int, first_micro_of_step: bool) -> None:
        self.tput_timer.start()
        if self._profile is not None and global_steps == self._profile.profile_step and first_micro_of_step:
            from autotuner.runtime.progress.flops_profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(self._engine.module, self._engine,
                                                self._profile.recompute_fwd_factor)
            self.flops_profiler.start_profile()
            self._profiling = True

    def forward_done(self, seconds: float) -> None:
        if self.wall_clock is not None:
            self.wall_clock.forward(seconds)
        if self._profiling:
            self.flops_profiler.stop_profile()

    def backward_done(self, loss: torch.Tensor, seconds: float) -> None:
        if self.wall_clock is not None:
            self.wall_clock.backward(seconds)
        if self._profiling and self.flops_profiler.bwd_latency is None:
            self.flops_profiler.bwd_latency = seconds
        if self.monitor.enabled and self._rank == 0:
            self._window_losses.append(loss.detach().float().mean())  # read once per window, at the boundary

    def step_done(self, seconds: float, boundary: bool) -> None:
        engine = self._engine
        self.tput_timer.stop(global_step=boundary, report_speed=self._rank == 0)
        if self.wall_clock is not None:
            self.wall_clock.step(seconds)
        if boundary and self.monitor.enabled and self._rank == 0:
            self.monitor.write_events(self._events())
        if boundary and self._profiling:
            self._profiling = False
            self.flops_profiler.step_latency = seconds
            self._profile_print()
        if self.wall_clock is not None:
            self.wall_clock.print_and_reset(boundary)
        if boundary and engine.global_steps % engine.config.steps_per_print == 0:
            self._print(f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                        f"mom={engine.get_mom()}")

    def close(self) -> None:
        self.monitor.close()

    # ----- pieces -----
    def _events(self) -> list[tuple[str, float, int]]:
        engine = self._engine
        samples = engine.global_samples
        events = []
        if self._window_losses:
            events.append(("Train/Samples/train_loss", float(torch.stack(self._window_losses).mean()), samples))
            self._window_losses.clear()
        events.append(("Train/Samples/lr", engine.get_lr()[0], samples))
        if engine.fp16_enabled() and engine._grad_scaler is not None:
            events.append(("Train/Samples/loss_scale", float(engine._grad_scaler.get_scale()), samples))
        if self.wall_clock is not None:
            events += self.wall_clock.window_events(samples)
        return events

    def _profile_print(self) -> None:
        profile = self._profile
        self.flops_profiler.print_model_profile(profile_step=self._engine.global_steps,
                                                module_depth=profile.module_depth, top_modules=profile.top_modules,
                                                detailed=profile.detailed, output_file=profile.output_file)
        self.flops_profiler.end_profile()
