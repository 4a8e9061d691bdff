"""A warm rank: a process forked from the tuner's forkserver (torch and the script's libraries
already imported) that becomes what a cold rank would be, then runs the user's script.

It takes the very (cmd, env) a cold launch would exec (`launch.plan.rank_launch`) and applies it
in-process: a session of its own, the environment replaced, stdout/stderr to the experiment's
files, the core binding and per-rank log of `rank_entry`, torch's thread count from
OMP_NUM_THREADS, fresh random state, multiprocessing's default start method, then `run_script.run`. It leaves with the script's exit
status after the script's atexit handlers ran, as an interpreter would.
"""

from __future__ import annotations

import atexit
import io
import os
import random
import sys
from dataclasses import dataclass

from autotuner.core.parent_death import die_with_parent

RUN_SCRIPT = "autotuner.launch.run_script"
RANK_ENTRY = "autotuner.launch.rank_entry"
UNSAFE_FORK_EXIT = 117  # the forkserver had touched CUDA: the tuner falls back to cold launches


@dataclass(frozen=True)
class WarmRankSpec:
    """What one rank runs: a cold rank's command and environment, where its output goes, and where."""

    command: tuple[str, ...]
    env: dict
    cwd: str
    stdout_path: str
    stderr_path: str
    parent_pid: int  # the forkserver's: the rank dies with it


def _redirect(stdout_path: str, stderr_path: str) -> None:
    """fd 1 and 2 to the experiment's files (appending: ranks share them), unbuffered like `python -u`."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")


def script_argv(command: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(rank_entry arguments, run_script arguments) of a rank command built by launch.plan."""
    entry: list[str] = []
    rest = list(command)
    if rest[1:3] == ["-m", RANK_ENTRY]:
        split = rest.index("--")
        entry, rest = rest[3:split], rest[split + 1:]
    if rest[1:4] != ["-u", "-m", RUN_SCRIPT]:
        raise ValueError(f"not a tuner's rank command: {command}")
    return entry, rest[4:]


def _apply_rank_entry(arguments: list[str]) -> None:
    from autotuner.launch import rank_entry

    rank_entry.apply(rank_entry.parse(arguments))


def _fresh_random_state() -> None:
    # A fresh interpreter seeds Python's and numpy's generators from the OS, and starts torch's at
    # its default seed; forked processes would all share the forkserver's state.
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    import torch

    torch.manual_seed(torch.initial_seed())


def _default_start_method() -> None:
    # The forkserver's children inherit its start method ("forkserver"); a fresh interpreter starts
    # with the platform's default. A script's DataLoader workers would otherwise be started through
    # a new forkserver of their own, with the dataset pickled to them: seconds per launch.
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)


def main(index: int, specs: tuple[WarmRankSpec, ...]) -> None:
    """torch.multiprocessing's entry for local rank `index`. Never returns."""
    spec = specs[index]
    die_with_parent(spec.parent_pid)  # first: nothing below may outlive the forkserver
    os.setsid()  # a session of our own: the runner ends this rank's whole tree by its group
    os.chdir(spec.cwd)
    os.environ.clear()
    os.environ.update(spec.env)
    _redirect(spec.stdout_path, spec.stderr_path)
    status = 1
    try:
        import torch

        if torch.cuda._is_in_bad_fork():  # noqa: SLF001 - torch's own check of a forked CUDA state
            print("autotuner: warm start: the forkserver had initialised CUDA; this launch cannot use the GPU",
                  file=sys.stderr)
            status = UNSAFE_FORK_EXIT
            return
        entry, argv = script_argv(spec.command)
        if entry:
            _apply_rank_entry(entry)
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        _fresh_random_state()
        _default_start_method()
        from autotuner.launch.run_script import run

        status = run(argv)
        atexit._run_exitfuncs()  # noqa: SLF001 - an interpreter's exit runs them; os._exit below would not
    except BaseException:  # noqa: BLE001 - a fault of ours, not the script's: shown, then status 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)
