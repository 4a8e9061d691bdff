"""A trial's launch mechanics: the files it starts from (`prepare`), the (cmd, env) that starts
it, and the verdict read from what it left behind (`judge`). The trial itself, its settings and
its scoring are the tuner's data (tuning/trials/trial.py); the runners here use both.

The verdict comes from the exit status and the files the launch leaves (the launcher's report,
metrics.json or model_info.json, OOM markers), never from reading its logs.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
from pathlib import Path

from autotuner.core.atomic import write_json_atomic
from autotuner.core.boundary import (DIST_TIMEOUT_ENV, REQUEST_ENV, Measurement, ModelInfo, RecordError,
                                     read_record, write_record)
from autotuner.core.launch_records import LaunchReport
from autotuner.core.parent_death import LAUNCHED_BY_PID_ENV
from autotuner.launch.options import LaunchOptions
from autotuner.launch.script_args import replace_config
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.journal import RECORD_FILE
from autotuner.tuning.trials.trial import (CONFIG_FILE, LAUNCH_REPORT_FILE, METRICS_FILE, MODEL_INFO_FILE,
                                           RANK_ERRORS_DIR, WARM_RANKS_FILE, Trial, experiment_config,
                                           launched_config, mapped_script_args, scored)


def trial_script_args(trial: Trial) -> tuple[str, ...]:
    """The user's arguments with the experiment's mapped values and its own config file."""
    config = experiment_config(trial.experiment, trial.settings)
    args = mapped_script_args(trial.settings.script_args, trial.settings.arg_mappings, config)
    return replace_config(args, str(trial.directory / CONFIG_FILE))


def launch_options(trial: Trial) -> LaunchOptions:
    """The launcher's options for a trial: what `launcher [flags] script args` would be given."""
    settings = trial.settings
    flags = settings.rank_flags
    return LaunchOptions(script=settings.script, script_args=trial_script_args(trial),
                         nproc_per_node=None if flags.picks_ranks_itself else settings.nproc_per_node,
                         hostfile=flags.hostfile, include=flags.include, exclude=flags.exclude,
                         no_local_rank=flags.no_local_rank, bind_cores_to_rank=flags.bind_cores_to_rank,
                         bind_core_list=flags.bind_core_list, master_port=flags.master_port,
                         report_file=str(trial.report_path))


def trial_environment(trial: Trial, environ: dict[str, str]) -> dict[str, str]:
    """The environment every launch of a trial starts from: the request file is named, output
    unbuffered, and the ranks' rendezvous and store waits bounded by the experiment's time limit
    (ours through DIST_TIMEOUT_ENV, DeepSpeed's through its DEEPSPEED_TIMEOUT, in minutes)."""
    timeout_s = trial.settings.timeout_s
    return {**environ, REQUEST_ENV: str(trial.request_path), "PYTHONUNBUFFERED": "1",
            DIST_TIMEOUT_ENV: f"{timeout_s:g}", "DEEPSPEED_TIMEOUT": str(max(1, math.ceil(timeout_s / 60)))}


def cold_launch(trial: Trial, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(cmd, env) of a cold launch: `python -m autotuner --report_file F [launcher flags] script args`,
    a fresh launcher process that starts fresh rank interpreters through torch elastic."""
    command = [trial.settings.python, "-m", "autotuner", *launch_options(trial).to_argv()]
    # The launcher dies with the tuner (parent_death): a killed tuner leaves no experiment running.
    return command, {**trial_environment(trial, environ), LAUNCHED_BY_PID_ENV: str(os.getpid())}


def reproduce_line(trial: Trial) -> str:
    """cmd.txt: the trial's cold launch as one shell line (with the request variable), to rerun by hand."""
    command, _ = cold_launch(trial, {})
    return shlex.join(["env", f"{REQUEST_ENV}={trial.request_path}", *command]) + "\n"


def prepare(trial: Trial) -> None:
    """Write the trial's config and measurement request; remove anything an earlier launch left, so a
    stale metrics file or report can never be read as this launch's."""
    directory = trial.directory
    directory.mkdir(parents=True, exist_ok=True)
    stale = [directory / name for name in (METRICS_FILE, MODEL_INFO_FILE, LAUNCH_REPORT_FILE, RECORD_FILE,
                                           WARM_RANKS_FILE)]
    for path in [*stale, *directory.glob(f"{METRICS_FILE}.oom-rank*")]:
        path.unlink(missing_ok=True)
    shutil.rmtree(directory / RANK_ERRORS_DIR, ignore_errors=True)
    write_json_atomic(directory / CONFIG_FILE, launched_config(trial.experiment, trial.settings))
    write_record(trial.request_path, trial.request())
    (directory / "cmd.txt").write_text(reproduce_line(trial))


def extension_lock_hint() -> str:
    """A torch extension build killed midway (a rank ended on a time limit while DeepSpeed
    JIT-built an op) leaves its `lock` file, and every later build of that op waits on it for
    ever: seen here, every later launch on DeepSpeed's CPU engine timed out. Named when present."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    locks = sorted(str(p) for pattern in ("*/lock", "*/*/lock") for p in root.glob(pattern)) if root.is_dir() else []
    if not locks:
        return ""
    return (f"; torch extension build lock(s) exist: {', '.join(locks)} (a build killed midway leaves one, and "
            "every later build of that op waits on it; delete it if no build is running)")


def judge(trial: Trial, returncode: int | None, timed_out: bool, wall_time_s: float) -> TrialResult:
    """Turn what a launch left behind into a TrialResult: the time limit, OOM markers, the launcher's
    report, then the measurement or model info. Logs are never read."""
    directory, settings = trial.directory, trial.settings
    common = dict(experiment=trial.experiment, predicted_memory_bytes=trial.predicted_memory_bytes,
                  wall_time_s=wall_time_s)
    if timed_out:
        return TrialResult(state=TrialState.TIMEOUT, error=f"exceeded exp_timeout_s={settings.timeout_s:g}s; "
                           f"the whole process tree was killed{extension_lock_hint()}", **common)
    oom_markers = sorted(directory.glob(f"{METRICS_FILE}.oom-rank*"))
    if oom_markers:
        ranks = ", ".join(p.name.rsplit("rank", 1)[1] for p in oom_markers)
        return TrialResult(state=TrialState.OOM, error=f"out of memory on rank {ranks}", **common)
    try:
        report = read_record(trial.report_path, LaunchReport)
    except RecordError:
        report = None
    if returncode != 0 or (report is not None and report.exit_code != 0):
        return TrialResult(state=TrialState.FAILED, error=failure_text(report, returncode), **common)
    if trial.profile:
        info = _read(directory / MODEL_INFO_FILE, ModelInfo)
        if info is None:
            return TrialResult(state=TrialState.FAILED, error="no model_info.json: the script exited before its "
                               "first optimizer step finished (does it train through the engine?)", **common)
        common["model_info"] = info
    measurement = _read(directory / METRICS_FILE, Measurement)
    if measurement is None:
        return TrialResult(state=TrialState.FAILED, error="no metrics: the script exited 0 without reaching "
                           f"end_profile_step={settings.end_profile_step} (does it train that many steps?)", **common)
    return scored(measurement, settings, common)


def _read(path: Path, kind):
    try:
        return read_record(path, kind)
    except RecordError:
        return None


def failure_text(report: LaunchReport | None, returncode: int | None) -> str:
    """`rank N: <its exception line>`, or `rank N: exit status S (killed by SIG...)` when it raised none."""
    if report is None or report.failed_rank is None:
        status = report.exit_code if report is not None else returncode
        return describe_status(status)
    detail = report.exception or describe_status(report.rank_exit_status)
    return f"rank {report.failed_rank}: {detail}"


def describe_status(status: int | None) -> str:
    if status is not None and status > 128:
        try:
            return f"exit status {status} (killed by {signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return f"exit status {status}"
