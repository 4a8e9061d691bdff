"""What the tuner asks of a runner, the one way it launches anything: a Trial in, a TrialResult
out. The profile, the search, the final re-measurement and `--bench` all go through one. The
runners themselves (cold, warm, Ray) are in autotuner/execution/.

Every runner declares its parallel side: `capacity` slots, `submit` and `next_result`. A runner
with one slot gets them from `OneSlot`, which runs the trial at `next_result`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from autotuner.launch.options import LaunchOptions
from autotuner.launch.script_args import find_flag
from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.space.records import TrialResult


class Runner(Protocol):
    name: str
    capacity: int  # trials it can hold at once; the search submits up to this many
    # The hardware its trials run on, in words, where that is not this machine (a cluster's nodes):
    # the run's fingerprint takes it as its device, so a resume on other nodes reuses no record.
    hardware: str | None
    # Launcher flags that make the optimal command train where the trials ran (a cluster's nodes);
    # none: on the machine it is run on.
    placement_flags: tuple[str, ...]
    placement_env: tuple[tuple[str, str], ...]  # variables the trials' ranks had that a launch would set otherwise

    def run(self, trial: Trial) -> TrialResult:
        """Launch the trial's ranks, wait (at most the trial's timeout), end every process it started,
        and return the verdict. Never raises for a failed launch: failures are results."""

    def submit(self, trial: Trial) -> None:
        """Start the trial in a free slot (at most `capacity` held at once)."""

    def next_result(self) -> tuple[Trial, TrialResult]:
        """Wait for one held trial to finish, whichever finishes first."""

    def train(self, options: LaunchOptions, quiet: bool) -> int:
        """Train with the optimum (`--autotuning run`): the user's job, to its end, output to the
        terminal. Returns the job's exit status."""

    def close(self) -> None:
        """Release what the runner holds (a forkserver, say)."""


@dataclass(frozen=True)
class Placement:
    """Where a runner's experiments run, as the job and the optimal command need it: the hardware
    in words where it is not this machine (None: this machine's), the launcher flags and the
    variables that make the optimal command train there."""

    hardware: str | None = None
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, runner: object) -> "Placement":
        """A runner's (a plugin's may declare none of it: this machine's then)."""
        return cls(getattr(runner, "hardware", None), tuple(getattr(runner, "placement_flags", ())),
                   tuple(getattr(runner, "placement_env", ())))

    @property
    def nodes(self) -> int:
        """The nodes the optimal command trains on: each experiment's, as the flags say."""
        found = find_flag(self.flags, "--num_nodes")
        return int(found[1]) if found and found[1] else 1

    @property
    def rendezvous(self) -> bool:
        """The optimal command meets its nodes through a rendezvous endpoint (run on each node)."""
        return "--rdzv_endpoint" in self.flags


class OneSlot:
    """The parallel side of a runner with one slot: a submitted trial runs at `next_result`."""

    capacity = 1
    hardware: str | None = None  # this machine's: the settled fingerprint's device already
    placement_flags: tuple[str, ...] = ()
    placement_env: tuple[tuple[str, str], ...] = ()

    def __init__(self) -> None:
        self._submitted: deque[Trial] = deque()

    def submit(self, trial: Trial) -> None:
        self._submitted.append(trial)

    def next_result(self) -> tuple[Trial, TrialResult]:
        trial = self._submitted.popleft()
        return trial, self.run(trial)  # type: ignore[attr-defined]
