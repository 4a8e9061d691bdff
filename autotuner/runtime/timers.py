"""Wall-clock timers for forward, backward, optimizer step and whole training steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from autotuner.boundary import Summary  # noqa: F401  (re-exported)


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
    """Durations recorded for optimizer steps start..end inclusive (steps count from 1)."""

    start_step: int
    end_step: int
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_wall_s: list[float] = field(default_factory=list)

    def covers(self, step: int) -> bool:
        return self.start_step <= step <= self.end_step

    def record_micro(self, step: int, forward: float, backward: float) -> None:
        if self.covers(step):
            self.forward_s.append(forward)
            self.backward_s.append(backward)

    def record_step(self, step: int, optimizer_step: float, wall: float) -> None:
        if self.covers(step):
            self.step_s.append(optimizer_step)
            self.step_wall_s.append(wall)
