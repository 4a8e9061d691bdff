"""How a measurement rank leaves: at once, after ending the processes it started.

A measurement launch ends with os._exit, because interpreter teardown can deadlock (DDP's Reducer,
DeepSpeed's threads). os._exit skips the finalizers that stop a DataLoader's worker processes, and
DeepSpeed's own loader starts two per GPU. Orphaned, those workers outlived the rank for up to 5 s
(their watchdog's poll interval). On a GPU they hold the rank's CUDA file descriptors, so the rank's
device memory was not freed: on an H200 the next experiment failed with "Process N has 137.96 GiB
memory in use". So the rank ends its descendants first, and reaps them.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil

REAP_TIMEOUT_S = 5.0


def end_descendants(timeout_s: float = REAP_TIMEOUT_S) -> None:
    """SIGKILL every process this one started (and theirs), then wait for them: nothing they hold
    is needed once the measurement is written."""
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    if not descendants:
        return
    try:
        # torch's DataLoader raises "worker killed" from its SIGCHLD handler; these deaths are ours.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread: no Python handler can run here either
        pass
    for process in descendants:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=timeout_s)


def leave_now(status: int = 0) -> None:
    """Flush, end what this rank started, and exit without interpreter teardown."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    end_descendants()
    os._exit(status)
