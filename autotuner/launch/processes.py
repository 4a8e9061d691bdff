"""Run a command as a child process group with a time limit, and always end its whole tree.

torch elastic puts each rank in a session of its own, so killing the launcher's process
group is not enough: descendants are collected with psutil (by parentage, never by name)
and every one of them is ended (launch/stopping.py).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from autotuner.launch.stopping import GRACE_S, end_processes


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None when the time limit ended it
    timed_out: bool
    wall_time_s: float


def end_process_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child and its group (a launcher then stops its ranks), SIGKILL what is left."""
    try:
        end_processes([psutil.Process(proc.pid)], grace_s)
    except psutil.NoSuchProcess:
        pass
    proc.wait()


def run_to_completion(
    command: list[str], *, stdout: Path, stderr: Path, timeout_s: float, env: dict[str, str], cwd: str | None = None
) -> ProcessOutcome:
    """Run `command` with output to files. On timeout, Ctrl-C or any error its tree is ended."""
    started = time.monotonic()
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
            return ProcessOutcome(returncode, False, time.monotonic() - started)
        except subprocess.TimeoutExpired:
            end_process_tree(proc)
            return ProcessOutcome(None, True, time.monotonic() - started)
        except BaseException:
            end_process_tree(proc)
            raise
        finally:
            if proc.poll() is None:
                end_process_tree(proc)
