"""Measuring chosen experiments outside a tuning run, on the tuner's own runners and in-rank
measurement: the public API the benchmarks use to re-measure picks interleaved (and a user can
use to check a pick). Nothing here has defaults the tuner does not share."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from autotuner.core.engine_kind import Engine
from autotuner.core.atomic import write_json_atomic
from autotuner.config import load_config
from autotuner.config.batch import data_parallel_size
from autotuner.execution.cold import ColdRunner
from autotuner.execution.warm import WarmRunner
from autotuner.launch.processes import ProcessOutcome, run_to_completion
from autotuner.launch.script_args import config_path
from autotuner.tuning.space.config_space import base_config
from autotuner.tuning.trials.trial import ExperimentSettings, Trial
from autotuner.tuning.trials.journal import RECORD_FILE
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.trials.runner import Runner
from autotuner.tuning.space.experiment import Experiment

RESULT_FILE = "result.json"  # a measured result, as measure_once writes it

__all__ = ["Experiment", "ExperimentSettings", "TrialResult", "TrialState", "cold_runner", "measure",
           "journaled_result", "measure_once", "measurement_settings", "run_command", "warm_runner"]


def measurement_settings(script: str | Path, script_args: tuple[str, ...], config: dict[str, Any], *,
                         nproc_per_node: int = 2, start_profile_step: int = 3, end_profile_step: int = 5,
                         arg_mappings: dict[str, str] | None = None, memory_budget_bytes: int | None = None,
                         engine: Engine = Engine.OURS, timeout_s: float = 300) -> ExperimentSettings:
    """Settings to measure experiments of `script` over one node's ranks, from a ds.json dict
    (its autotuning section is not used: each experiment sets the batch triad and stage). The
    config flag is added to the script's arguments when they have none; each trial points it
    at the experiment's own config."""
    checked = load_config({key: value for key, value in config.items() if key != "autotuning"})
    args = tuple(script_args) if config_path(tuple(script_args)) else (*script_args, "--deepspeed", "ds.json")
    return ExperimentSettings(script=str(script), script_args=args, base_config=base_config(checked),
                              nproc_per_node=nproc_per_node, data_parallel_size=data_parallel_size(nproc_per_node),
                              objective=Objective("throughput"), timeout_s=timeout_s,
                              start_profile_step=start_profile_step, end_profile_step=end_profile_step,
                              arg_mappings=dict(arg_mappings or {}), memory_budget_bytes=memory_budget_bytes,
                              engine=engine)


def cold_runner() -> Runner:
    return ColdRunner()


def warm_runner(script: str | Path, report: Callable[[str], None] = print) -> Runner:
    """Forks ranks from a forkserver that preloaded `script`'s imports; close() it when done."""
    return WarmRunner(str(script), report=report)


def measure(experiment: Experiment, settings: ExperimentSettings, directory: str | Path,
            runner: Runner | None = None) -> TrialResult:
    """One launch of `experiment` in `directory`, measured as the tuner measures its own."""
    return (runner or ColdRunner()).run(Trial(experiment, Path(directory), settings))


def measure_once(experiment: Experiment, settings: ExperimentSettings, directory: str | Path,
                 reuse: bool = True) -> TrialResult:
    """`measure`, keeping the result in `directory`; with `reuse`, a result an earlier
    (interrupted) run kept there for this experiment is read back, not launched again."""
    record = Path(directory) / RESULT_FILE
    if reuse and record.exists():
        result = TrialResult.from_json(json.loads(record.read_text()))
        if result.experiment == experiment:
            return result
    result = measure(experiment, settings, directory)
    write_json_atomic(record, result.to_json())
    return result


def journaled_result(experiment_dir: str | Path) -> TrialResult:
    """The result a tuning run journaled for one experiment (autotuning_exps/<name>/)."""
    return TrialResult.from_json(json.loads((Path(experiment_dir) / RECORD_FILE).read_text())["result"])


def run_command(command: list[str], directory: str | Path, timeout_s: float,
                env: dict[str, str] | None = None) -> ProcessOutcome:
    """`command` (a launcher run, say) in `directory`, output to stdout.log/stderr.log there; on a
    timeout or Ctrl-C its whole process tree is ended."""
    directory = Path(directory)
    return run_to_completion(command, stdout=directory / "stdout.log", stderr=directory / "stderr.log",
                             timeout_s=timeout_s, env=env if env is not None else dict(os.environ), cwd=str(directory))
