"""Running one experiment: its directory, config, command, launch, and the verdict.

The verdict comes from the exit status and the files the ranks leave (metrics.json,
OOM markers), never from searching stderr for "error".
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotuner.errors import ConfigError
from autotuner.launch.plan import picks_ranks_itself
from autotuner.launch.processes import run_to_completion
from autotuner.launch.script_args import replace_config, set_flag
from autotuner.atomic import write_json_atomic
from autotuner.tuning.records import Objective, TrialResult, TrialState
from autotuner.tuning.space import Experiment

METRICS_FILE = "metrics.json"
RECORD_FILE = "exp.json"


@dataclass(frozen=True)
class ExperimentSettings:
    """Everything fixed across experiments of one tuning run."""

    script: str
    script_args: tuple[str, ...]
    base_config: dict[str, Any] = field(hash=False)
    nproc_per_node: int
    data_parallel_size: int
    objective: Objective
    timeout_s: float
    start_profile_step: int = 3
    end_profile_step: int = 5
    arg_mappings: dict[str, str] = field(default_factory=dict, hash=False)
    launcher_args: tuple[str, ...] = ()
    memory_budget_bytes: int | None = None  # per rank; above it a CPU run counts as OOM
    user_config: dict[str, Any] = field(default_factory=dict, hash=False)  # the file as the user wrote it
    python: str = sys.executable


def config_value(config: dict[str, Any], dotted_key: str) -> Any:
    value: Any = config
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"autotuning.arg_mappings: '{dotted_key}' is not a key of the experiment config")
        value = value[part]
    return value


def mapped_script_args(script_args: tuple[str, ...], arg_mappings: dict[str, str], config: dict[str, Any]) -> tuple[str, ...]:
    """The user's arguments with each mapped flag set to the experiment's value (added if absent)."""
    args = tuple(script_args)
    for key, flag in arg_mappings.items():
        args = set_flag(args, flag, str(config_value(config, key)))
    return args


def measurement_section(settings: ExperimentSettings, exp_dir: Path) -> dict[str, Any]:
    """The autotuning section of an experiment: measure the profile steps, write metrics, exit."""
    return {
        "enabled": True,
        "start_profile_step": settings.start_profile_step,
        "end_profile_step": settings.end_profile_step,
        "metric_path": str(exp_dir / METRICS_FILE),
    }


def experiment_config(experiment: Experiment, settings: ExperimentSettings,
                      autotuning: dict[str, Any] | None) -> dict[str, Any]:
    """The config a rank sees: the user's, with this experiment's values. Without an
    autotuning section the result is a plain training config (the optimum)."""
    config = experiment.apply(settings.base_config, settings.data_parallel_size)
    config.pop("autotuning", None)
    if autotuning is not None:
        config["autotuning"] = autotuning
    return config


def with_user_keys(user_config: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """The tuned config laid over the user's file, so keys we accept but do not act on (DeepSpeed's
    own) stay and DeepSpeed can train with the result. The autotuning section is left out."""
    merged = {key: copy.deepcopy(value) for key, value in user_config.items() if key != "autotuning"}
    for key, value in tuned.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **copy.deepcopy(value)}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def launch_command(config: dict[str, Any], config_path: Path, settings: ExperimentSettings) -> list[str]:
    """`python -m autotuner [launcher args] script [mapped args] --deepspeed <experiment config>`."""
    args = mapped_script_args(settings.script_args, settings.arg_mappings, config)
    args = replace_config(args, str(config_path))
    return [settings.python, "-m", "autotuner", *rank_count_flags(settings), *settings.launcher_args,
            settings.script, *args]


def rank_count_flags(settings: ExperimentSettings) -> tuple[str, ...]:
    """--nproc_per_node N, unless the user's --include/--exclude/--hostfile already set the count."""
    return () if picks_ranks_itself(settings.launcher_args) else ("--nproc_per_node", str(settings.nproc_per_node))


def _last_exception_line(stderr_text: str, rank: int | None = None) -> str | None:
    """The message of the last Python exception in the log (for the record, not for detection).

    torch prefixes a rank's traceback with "[rankN]:"; the failing rank's own line is preferred
    over its peers' follow-on errors (e.g. gloo's "Connection closed by peer")."""
    if rank is not None:
        # Only the failing rank's lines and unprefixed ones: a peer's follow-on error would mislead.
        own = "\n".join(line for line in stderr_text.splitlines()
                        if not re.match(r"\s*\[rank\d+\]:", line) or line.strip().startswith(f"[rank{rank}]:"))
        return _last_exception_line(own)
    patterns = (
        re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*)$"),
        re.compile(r"^(?:\[rank\d+\]:\s*)?([\w./-]+: error: .*)$"),  # argparse in the user's script
    )
    found = [m.group(1).strip() for line in stderr_text.splitlines()
             for pattern in patterns if (m := pattern.match(line.strip()))]
    return found[-1][:500] if found else None


def _exit_status(stderr_text: str, rank: int | None, returncode: int | None) -> str:
    """The failing rank's own exit status as the launcher logged it, named when it is a signal."""
    found = re.findall(rf"launcher: rank {rank} exited with status (\d+)", stderr_text) if rank is not None else []
    status = int(found[-1]) if found else returncode
    if status is not None and status > 128:
        try:
            return f"exit status {status} (killed by {signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return f"exit status {status}"


def _failed_rank(stderr_text: str) -> int | None:
    found = re.findall(r"launcher: rank (\d+) failed first", stderr_text)
    return int(found[-1]) if found else None


def classify(experiment: Experiment, exp_dir: Path, returncode: int | None, timed_out: bool, wall_time_s: float,
             settings: ExperimentSettings, predicted_memory: int | None) -> TrialResult:
    """Turn what the run left behind into a TrialResult."""
    metrics_path = exp_dir / METRICS_FILE
    oom_markers = sorted(exp_dir.glob(f"{METRICS_FILE}.oom-rank*"))
    stderr_text = (exp_dir / "stderr.log").read_text(errors="replace") if (exp_dir / "stderr.log").exists() else ""
    common = dict(experiment=experiment, predicted_memory_bytes=predicted_memory, wall_time_s=wall_time_s)
    if timed_out:
        return TrialResult(state=TrialState.TIMEOUT, error=f"exceeded exp_timeout_s={settings.timeout_s:g}s; "
                           "the whole process tree was killed", **common)
    if oom_markers:
        ranks = ", ".join(p.name.rsplit("rank", 1)[1] for p in oom_markers)
        return TrialResult(state=TrialState.OOM, error=f"out of memory on rank {ranks}", **common)
    if returncode != 0:
        rank = _failed_rank(stderr_text)
        where = f"rank {rank}: " if rank is not None else ""
        detail = _last_exception_line(stderr_text, rank) or _exit_status(stderr_text, rank, returncode)
        return TrialResult(state=TrialState.FAILED, error=f"{where}{detail}", **common)
    if not metrics_path.exists():
        return TrialResult(state=TrialState.FAILED, error="no metrics: the script exited 0 without reaching "
                           f"end_profile_step={settings.end_profile_step} (does it train that many steps?)", **common)
    import json

    metrics = json.loads(metrics_path.read_text())
    measured = metrics.get("peak_memory_bytes")
    common["measured_memory_bytes"] = measured
    if settings.memory_budget_bytes and measured and measured > settings.memory_budget_bytes:
        return TrialResult(state=TrialState.OOM, metrics=metrics, error=f"peak {measured / 2**20:.0f} MiB over the "
                           f"per-rank budget of {settings.memory_budget_bytes / 2**20:.0f} MiB", **common)
    value = metrics.get(settings.objective.key)
    if value is None:
        return TrialResult(state=TrialState.FAILED, metrics=metrics,
                           error=f"metrics.json has no '{settings.objective.key}'", **common)
    spread = metrics.get("throughput_std") if settings.objective.metric == "throughput" else None
    return TrialResult(state=TrialState.OK, value=float(value), value_std=spread, metrics=metrics, **common)


def prepare(experiment: Experiment, exp_dir: Path, settings: ExperimentSettings,
            autotuning: dict[str, Any]) -> list[str]:
    """Write ds_config.json and cmd.txt, remove any earlier run's metrics; return the command."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    for stale in [exp_dir / METRICS_FILE, *exp_dir.glob(f"{METRICS_FILE}.oom-rank*"), exp_dir / RECORD_FILE]:
        stale.unlink(missing_ok=True)  # a stale metrics file must never be read as this run's
    config_path = exp_dir / "ds_config.json"
    config = experiment_config(experiment, settings, autotuning)
    write_json_atomic(config_path, config)
    command = launch_command(config, config_path, settings)
    (exp_dir / "cmd.txt").write_text(shlex.join(command) + "\n")
    return command


def launch(command: list[str], exp_dir: Path, timeout_s: float):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return run_to_completion(command, stdout=exp_dir / "stdout.log", stderr=exp_dir / "stderr.log",
                             timeout_s=timeout_s, env=env)


def run_experiment(experiment: Experiment, exp_dir: Path, settings: ExperimentSettings,
                   predicted_memory: int | None = None) -> TrialResult:
    """Launch the experiment's ranks and record the result in exp_dir/exp.json."""
    command = prepare(experiment, exp_dir, settings, measurement_section(settings, exp_dir))
    outcome = launch(command, exp_dir, settings.timeout_s)
    result = classify(experiment, exp_dir, outcome.returncode, outcome.timed_out, outcome.wall_time_s,
                      settings, predicted_memory)
    write_json_atomic(exp_dir / RECORD_FILE, result.to_json())
    return result
