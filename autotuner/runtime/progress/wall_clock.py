"""`wall_clock_breakdown`: DeepSpeed's engine timers, printed by rank 0 as DeepSpeed prints them.

Each step() call prints the micro-step timers ("time (ms) | fwd_microstep: ... "); each optimizer
step prints the timers summed over its accumulation window ("time (ms) | fwd: ... | bwd: ... |
step: ...") and resets them. DeepSpeed also splits backward into bwd_inner and bwd_allreduce;
torch's DDP and FSDP2 overlap the reduction with backward, so we time backward whole and print
no split we did not measure.
"""

from __future__ import annotations

MICRO_TIMERS = ("fwd_microstep", "bwd_microstep", "step_microstep")
GLOBAL_TIMERS = ("fwd", "bwd", "step")


class WallClockBreakdown:
    def __init__(self, rank: int):
        self._print = rank == 0
        self.micro_ms = dict.fromkeys(MICRO_TIMERS, 0.0)
        self.global_ms = dict.fromkeys(GLOBAL_TIMERS, 0.0)
        self.cache: dict[str, float] = {}  # what get_wall_clock_timers() returns

    def forward(self, seconds: float) -> None:
        self.micro_ms["fwd_microstep"] = seconds * 1e3
        self.global_ms["fwd"] += seconds * 1e3

    def backward(self, seconds: float) -> None:
        self.micro_ms["bwd_microstep"] = seconds * 1e3
        self.global_ms["bwd"] += seconds * 1e3

    def step(self, seconds: float) -> None:
        self.micro_ms["step_microstep"] = seconds * 1e3
        self.global_ms["step"] += seconds * 1e3
        self.cache = {**self.micro_ms, **self.global_ms}

    def print_and_reset(self, boundary: bool) -> None:
        """After step(): the micro timers, and at the boundary the window's sums (then zeroed)."""
        self._log(self.micro_ms)
        if boundary:
            self._log(self.global_ms)

    def window_events(self, samples: int) -> list[tuple[str, float, int]]:
        """The monitor events DeepSpeed writes at the boundary (before the timers reset)."""
        return [(f"Train/Samples/elapsed_time_ms_{name}", self.global_ms[timer], samples)
                for name, timer in (("forward", "fwd"), ("backward", "bwd"), ("step", "step"))]

    def _log(self, timers: dict[str, float]) -> None:
        if self._print:
            print("[Rank 0] time (ms) | " + " | ".join(f"{name}: {ms:.2f}" for name, ms in timers.items()), flush=True)
        for name in timers:
            timers[name] = 0.0
