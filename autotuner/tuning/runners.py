"""Runners: the one way the tuner launches anything. A runner takes a Trial and returns a
TrialResult; the profile, the search and `--bench` all go through one.

`ColdRunner` starts a fresh launcher process per trial (torch elastic, fresh rank interpreters).
`WarmRunner` (tuning/warm.py) forks ranks from a forkserver that has already imported torch and
the script's libraries. Both prepare the trial's files the same way and judge the outcome from
the same files, so figures and verdicts do not depend on the path.
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

from autotuner.launch.plan import LaunchOptions, build_plan, config_checked
from autotuner.launch.runner import run_plan
from autotuner.launch.processes import run_to_completion
from autotuner.tuning.experiment import Trial, cold_launch, judge, prepare
from autotuner.tuning.records import TrialResult


class Runner(Protocol):
    name: str

    def run(self, trial: Trial) -> TrialResult:
        """Launch the trial's ranks, wait (at most the trial's timeout), end every process it started,
        and return the verdict. Never raises for a failed launch: failures are results."""

    def train(self, options: LaunchOptions, quiet: bool) -> int:
        """Train with the optimum (`--autotuning run`): the user's job, to its end, output to the
        terminal. Returns the job's exit status."""

    def close(self) -> None:
        """Release what the runner holds (a forkserver, say)."""


class ColdRunner:
    """Each trial is `python -m autotuner --report_file F ... script args` in a new session."""

    name = "cold"

    def run(self, trial: Trial) -> TrialResult:
        prepare(trial)
        command, env = cold_launch(trial, dict(os.environ))
        outcome = run_to_completion(command, stdout=trial.directory / "stdout.log",
                                    stderr=trial.directory / "stderr.log", timeout_s=trial.settings.timeout_s, env=env)
        return judge(trial, outcome.returncode, outcome.timed_out, outcome.wall_time_s)

    def train(self, options: LaunchOptions, quiet: bool) -> int:
        """The plain launcher's path: torch elastic in this process, as `launcher script ...` would."""
        return run_plan(config_checked(build_plan(options, sys.executable)), quiet=quiet)

    def close(self) -> None:
        pass
