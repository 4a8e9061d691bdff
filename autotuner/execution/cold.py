"""The cold runner: each trial is a fresh launcher process (torch elastic, fresh rank
interpreters). The warm runner (warm.py) forks ranks from a forkserver instead; both prepare
the trial's files the same way and judge the outcome from the same files, so figures and
verdicts do not depend on the path."""

from __future__ import annotations

import os
import sys

from autotuner.launch.elastic import run_plan
from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import build_plan, config_checked
from autotuner.launch.processes import run_to_completion
from autotuner.tuning.trials.trial import Trial
from autotuner.execution.trial_launch import cold_launch, judge, prepare
from autotuner.tuning.space.records import TrialResult
from autotuner.tuning.trials.runner import OneSlot


class ColdRunner(OneSlot):
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
