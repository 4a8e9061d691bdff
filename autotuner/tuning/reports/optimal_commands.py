"""The optimum's commands: our launcher's, and DeepSpeed's own launcher's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotuner.launch.script_args import find_flag, replace_config
from autotuner.tuning.trials.trial import ExperimentSettings, mapped_script_args, rank_count_flags


def optimal_script_args(settings: ExperimentSettings, config: dict[str, Any], config_path: Path) -> tuple[str, ...]:
    """The user's script arguments with the optimum's mapped values and config file."""
    return replace_config(mapped_script_args(settings.script_args, settings.arg_mappings, config), str(config_path))


def optimal_command(settings: ExperimentSettings, args: tuple[str, ...]) -> tuple[str, ...]:
    """The command that trains with the optimum: our launcher, the user's script, its arguments."""
    # The launcher of the interpreter the measured launches ran under, not whichever is first on PATH.
    launcher = Path(settings.python).parent / "launcher"
    prefix = [str(launcher)] if launcher.is_file() else [settings.python, "-m", "autotuner"]
    return (*prefix, *settings.placement_flags, *rank_count_flags(settings), *settings.rank_flags.to_argv(),
            settings.script, *args)


def nodes_per_run(settings: ExperimentSettings) -> int:
    """The nodes the optimal command trains on: each experiment's, as its placement flags say."""
    found = find_flag(settings.placement_flags, "--num_nodes")
    return int(found[1]) if found and found[1] else 1


def deepspeed_command(settings: ExperimentSettings, args: tuple[str, ...], on_gpu: bool) -> tuple[str, ...]:
    """The optimum as DeepSpeed's own launcher runs it: `deepspeed --num_gpus N script args`, with
    the user's DeepSpeed launcher flags (--include and friends set the count themselves). On a
    CPU-only machine DeepSpeed counts CPU slots from LOCAL_SIZE, so the command sets it."""
    count = rank_count_flags(settings)
    rank_flags = ("--num_gpus", count[1]) if count else ()
    env = () if on_gpu else ("env", f"LOCAL_SIZE={settings.nproc_per_node}")
    return (*env, "deepspeed", *rank_flags, *settings.rank_flags.to_argv(), settings.script, *args)
