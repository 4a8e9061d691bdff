"""`engine.tput_timer`: DeepSpeed's ThroughputTimer, with its names and its arithmetic.

It is started at each forward and stopped at each step() call. The first `start_step` optimizer
steps (2, as in DeepSpeed) are warm-up and not timed; avg_samples_per_sec() divides the batch by
the mean time of the steps after them. Every steps_per_print steps rank 0 prints DeepSpeed's line.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

TIME_EPSILON = 1e-6


class ThroughputTimer:
    def __init__(self, config: Any, batch_size: int, start_step: int = 2, steps_per_output: int | None = None,
                 device: torch.device | None = None, logging_fn: Callable[[str], None] | None = None):
        self.config = config  # timers.throughput: enabled, synchronized
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._cuda = device is not None and device.type == "cuda"
        self.logging = logging_fn or print

    def _now(self) -> float:
        if self._cuda and self.config.synchronized:
            torch.cuda.synchronize()
        return time.time()

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.config.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._now()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self.logging(
                        f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                        f"global_step={self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                        f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                        f"MemAllocated={self._gib(False)}GB, MaxMemAllocated={self._gib(True)}GB")
                self.step_elapsed_time = 0.0

    def _gib(self, peak: bool) -> float:
        if not self._cuda:
            return 0.0
        used = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
        return round(used / 2**30, 2)

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count > 0:
            timed_steps = self.global_step_count - self.start_step
            if timed_steps <= 0 or self.total_elapsed_time <= 0:
                return float("-inf")  # still warming up: DeepSpeed would divide by zero here
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
