"""The optimum's commands: our launcher's, and DeepSpeed's own launcher's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from autotuner.launch.plan import thread_env
from autotuner.launch.accelerate_launch import trains_through_accelerate
from autotuner.launch.script_args import CONFIG_FLAGS, config_path, replace_config, without_flag
from autotuner.tuning.trials.runner import Placement
from autotuner.tuning.trials.trial import ExperimentSettings, mapped_script_args, rank_count_flags


def optimal_script_args(settings: ExperimentSettings, config: dict[str, Any], config_path: Path) -> tuple[str, ...]:
    """The user's script arguments with the optimum's mapped values and config file."""
    return replace_config(mapped_script_args(settings.script_args, settings.arg_mappings, config), str(config_path))


def optimal_command(settings: ExperimentSettings, args: tuple[str, ...], tuned_values: Path | None = None,
                    placement: Placement = Placement()) -> tuple[str, ...]:
    """The command that trains with the optimum: our launcher, the user's script, its arguments,
    where the experiments ran (`placement`: a cluster's launcher flags and variables); with
    `tuned_values` (the pick's TunedValues file), `--tuned_values FILE` among the launcher's flags."""
    # The launcher of the interpreter the measured launches ran under, not whichever is first on PATH.
    launcher = Path(settings.python).parent / "launcher"
    prefix = [str(launcher)] if launcher.is_file() else [settings.python, "-m", "autotuner"]
    env = ("env", *(f"{name}={value}" for name, value in placement.env)) if placement.env else ()
    tuned = ("--tuned_values", str(tuned_values)) if tuned_values is not None else ()
    return (*env, *prefix, *placement.flags, *rank_count_flags(settings), *settings.rank_flags.to_argv(),
            *tuned, settings.script, *args)


def deepspeed_command(settings: ExperimentSettings, args: tuple[str, ...], on_gpu: bool,
                      environ: Mapping[str, str] | None = None,
                      placement: Placement = Placement()) -> tuple[str, ...] | None:
    """The optimum as DeepSpeed's own launcher runs it: `deepspeed --num_gpus N script args`, with
    the user's DeepSpeed launcher flags (--include and friends set the count themselves), as the
    experiments ran it. So: the thread count each rank had (DeepSpeed's launcher leaves
    OMP_NUM_THREADS unset, and every rank then takes every core); the GPUs they had, where
    CUDA_VISIBLE_DEVICES chose them (DeepSpeed drops it under --num_gpus and takes GPUs 0..N-1:
    --include names them, or, with the user's own --include/--exclude over it, none is written);
    DeepSpeed's launcher beside the measured interpreter; on a CPU-only machine, LOCAL_SIZE, from
    which DeepSpeed counts CPU slots. None where the experiments ran on several nodes: DeepSpeed's
    launcher needs a hostfile for that, and without one trains on one node."""
    if placement.nodes > 1:
        return None
    environ = os.environ if environ is None else environ
    if trains_through_accelerate(settings.script):
        return accelerate_command(settings, args, on_gpu, placement)
    count = rank_count_flags(settings)
    rank_flags: tuple[str, ...] = ("--num_gpus", count[1]) if count else ()
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if on_gpu and visible:
        ids = [part.strip() for part in visible.split(",")]
        if not count or not all(part.isdigit() for part in ids) or len(ids) < settings.nproc_per_node:
            return None
        rank_flags = ("--include", "localhost:" + ",".join(ids[:settings.nproc_per_node]))
    threads = environ.get("OMP_NUM_THREADS") or thread_env(settings.nproc_per_node, {})["OMP_NUM_THREADS"]
    env = ("env", f"OMP_NUM_THREADS={threads}", *(() if on_gpu else (f"LOCAL_SIZE={settings.nproc_per_node}",)))
    launcher = Path(settings.python).parent / "deepspeed"
    program = str(launcher) if launcher.is_file() else "deepspeed"
    return (*env, program, *rank_flags, *settings.rank_flags.to_argv(), settings.script, *args)


def accelerate_command(settings: ExperimentSettings, args: tuple[str, ...], on_gpu: bool,
                       placement: Placement = Placement()) -> tuple[str, ...] | None:
    """For a script that trains through accelerate: `accelerate launch --use_deepspeed
    --deepspeed_config_file CONFIG --num_processes N script args`, as accelerate's users run it. None
    on a CPU-only machine, where accelerate counts one process under DeepSpeed however many run
    (launch/accelerate_launch.py), and with several nodes or the deepspeed launcher's device flags."""
    config = config_path(args)
    if not on_gpu or config is None or placement.flags or settings.rank_flags.to_argv():
        return None
    for flag in CONFIG_FLAGS:
        args = without_flag(args, flag)
    launcher = Path(settings.python).parent / "accelerate"
    program = str(launcher) if launcher.is_file() else "accelerate"
    return (program, "launch", "--use_deepspeed", "--deepspeed_config_file", config, "--num_processes",
            str(settings.nproc_per_node), settings.script, *args)
