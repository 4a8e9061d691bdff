"""Wall-clock timers for forward, backward, optimizer step and whole training steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from autotuner.core.boundary import Summary  # noqa: F401  (re-exported)


class Stopwatch:
    """Measures one phase; synchronises CUDA so GPU work is inside the interval."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._started: float | None = None

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._started = self.now()

    def stop(self) -> float:
        if self._started is None:
            return 0.0
        elapsed = self.now() - self._started
        self._started = None
        return elapsed


@dataclass
class ProfileWindow:
    """Durations recorded for optimizer steps start..end inclusive (steps count from 1).

    A window shorter than `min_window_s` is extended one step at a time, up to `max_steps` steps:
    three steps of a small model last a tenth of a second, which says little on a busy machine."""

    start_step: int
    end_step: int
    min_window_s: float = 0.0
    max_steps: int = 0
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_wall_s: list[float] = field(default_factory=list)
    planned_end_step: int = 0  # end_step as asked, before any extension
    # The steps before the window, from the first forward: their excess over the steady step is
    # a one-off the planned run pays too (torch.compile's compiling, above all).
    warmup_steps: int = 0
    warmup_s: float = 0.0
    # Per step up to the window's end: the longest input of its micro-steps (dim 1 of the first tensor input; 0
    # when the input is no sequence) and the memory peak so far after it (the allocator's on a
    # GPU, the resident set's mark on a CPU: both only rise). A script whose batches
    # vary in length (dynamic padding) shows its memory per position here.
    step_lengths: list[int] = field(default_factory=list)
    step_peaks: list[int] = field(default_factory=list)
    bytes_before_first_step: int = 0  # the peak when the first forward began: what no batch's length moves

    def __post_init__(self) -> None:
        self.planned_end_step = self.planned_end_step or self.end_step

    def covers(self, step: int) -> bool:
        return self.start_step <= step <= self.end_step

    def record_micro(self, step: int, forward: float, backward: float) -> None:
        if self.covers(step):
            self.forward_s.append(forward)
            self.backward_s.append(backward)

    def record_step(self, step: int, optimizer_step: float, wall: float) -> None:
        if step < self.start_step:
            self.warmup_steps += 1
            self.warmup_s += wall
        if self.covers(step):
            self.step_s.append(optimizer_step)
            self.step_wall_s.append(wall)

    def record_peak(self, step: int, length: int, peak_bytes: int) -> None:
        """From step 1 (whose peak is the baseline a later longer batch must raise) to the window's end."""
        if step <= self.end_step:
            self.step_lengths.append(int(length))
            self.step_peaks.append(int(peak_bytes))

    def extend_if_short(self, step: int, agreed_seconds: Callable[[float], float]) -> bool:
        """At the window's last step: lengthen it by one step while it has lasted less than
        min_window_s and holds fewer than max_steps steps. Every rank calls this at the same step,
        and `agreed_seconds` makes the ranks decide on one figure (the longest), so all go on or
        all stop together."""
        if step != self.end_step or self.min_window_s <= 0 or len(self.step_wall_s) >= self.max_steps:
            return False
        if agreed_seconds(sum(self.step_wall_s)) >= self.min_window_s:
            return False
        self.end_step += 1
        return True
