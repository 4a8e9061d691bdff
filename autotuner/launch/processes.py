"""Run a command as a child process group with a time limit, and always end its whole tree.

torch elastic puts each rank in a session of its own, so killing the launcher's process
group is not enough: descendants are collected with psutil (by parentage, never by name)
before any signal is sent, and every one of them is ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

GRACE_S = 10.0


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None when the time limit ended it
    timed_out: bool
    wall_time_s: float


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def end_process_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's group (the launcher then stops its ranks), then SIGKILL whatever is left."""
    tree = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    tree += [p for p in _descendants(proc.pid) if p not in tree]
    _, alive = psutil.wait_procs(tree, timeout=max(0.0, deadline - time.monotonic()))
    for leftover in alive:
        try:
            leftover.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    psutil.wait_procs(alive, timeout=5)


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
