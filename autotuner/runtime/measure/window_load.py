"""How busy the machine was during a profile window, apart from our own ranks.

Each rank samples its own CPU time, the node's busy CPU time and the wall clock when the window
starts and ends. Rank 0 then has, for every node, the CPU time other processes took during the
window as a share of all the node's CPUs: (node busy - our ranks there) / (wall x CPUs). A
window in which another process took a large share did not measure what it set out to, and
the tuner measures that experiment again (tuning/trials/interference.py).
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import psutil

from autotuner.runtime.measure.leaving import leave_now

GROUP_RANK_ENV = "GROUP_RANK"  # torch elastic: this node's index


@dataclass(frozen=True)
class LoadSample:
    own_cpu_s: float  # this process, every thread
    node_busy_s: float  # every CPU of this node, not idle
    wall_s: float

    @classmethod
    def now(cls) -> "LoadSample":
        own = psutil.Process().cpu_times()
        node = psutil.cpu_times()
        idle = node.idle + getattr(node, "iowait", 0.0)
        busy = sum(node) - idle - getattr(node, "guest", 0.0) - getattr(node, "guest_nice", 0.0)
        return cls(own.user + own.system, busy, time.monotonic())


def window_figures(start: LoadSample, end: LoadSample) -> list[float]:
    """This rank's figures for the gather: own CPU s, node busy s, wall s, CPUs, node index."""
    return [end.own_cpu_s - start.own_cpu_s, end.node_busy_s - start.node_busy_s, end.wall_s - start.wall_s,
            float(psutil.cpu_count() or 1), float(os.environ.get(GROUP_RANK_ENV, "0"))]


# The kernel counts CPU time in ticks of 10 ms: a shorter window's share would be mostly rounding.
MIN_JUDGED_S = 0.5


def others_share(per_rank: list[list[float]]) -> float | None:
    """The largest share, over nodes, of a node's CPU time that processes other than our ranks
    took; None for a window too short to tell."""
    if max((r[2] for r in per_rank), default=0.0) < MIN_JUDGED_S:
        return None
    nodes: dict[float, list[list[float]]] = {}
    for figures in per_rank:
        nodes.setdefault(figures[4], []).append(figures)
    shares = []
    for ranks in nodes.values():
        ours = sum(r[0] for r in ranks)
        busy = max(r[1] for r in ranks)  # every rank on a node sees the same counters
        wall, cpus = max(r[2] for r in ranks), ranks[0][3]
        if wall > 0:
            shares.append(max(0.0, busy - ours) / (wall * cpus))
    return max(shares, default=0.0)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class WindowWatch:
    """Watches one profile window on a rank, for our engine and for DeepSpeed's alike: when it
    starts, whether it must go on (too short to trust), and the machine's load during it.
    The collective calls happen on every rank at the same step."""

    def __init__(self, window: Any, device: Any, active: bool):
        self.window = window
        self.device = device
        self.active = active  # only a launch that writes metrics watches its window
        self._start: LoadSample | None = None

    def note_steps_done(self, completed_steps: int) -> None:
        """The window's first step begins once `start_step - 1` steps are done."""
        if self.active and completed_steps == self.window.start_step - 1:
            self._start = LoadSample.now()

    def _agreed_max(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def goes_on(self, step: int, write_so_far: Callable[[], None]) -> bool:
        """At the window's last step: extend it while it is too short. The first time, the
        measurement so far is written, so a script that stops before the longer window ends
        still leaves one."""
        if not self.window.extend_if_short(step, self._agreed_max):
            return False
        if step == self.window.planned_end_step:
            write_so_far()
            # If the script's own loop ends first, the ranks leave as a measurement launch always
            # does, without the interpreter teardown that can hang on DDP's reducer (measurement.py).
            atexit.register(leave_now)
        return True

    def others_share(self) -> float | None:
        """The largest share of a node's CPUs other processes took during the window (collective)."""
        import torch
        import torch.distributed as dist

        if self._start is None:
            return None
        mine = window_figures(self._start, LoadSample.now())
        if not dist.is_initialized():
            return others_share([mine])
        tensor = torch.tensor(mine, dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return others_share([t.tolist() for t in gathered])
