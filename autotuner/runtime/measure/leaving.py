"""How a measurement rank leaves: at once, after ending the processes it started.

A measurement launch ends with os._exit, because interpreter teardown can deadlock (DDP's Reducer,
DeepSpeed's threads). os._exit skips the finalizers that stop a DataLoader's worker processes, and
DeepSpeed's own loader starts two per GPU. Orphaned, those workers outlived the rank for up to 5 s
(their watchdog's poll interval). On a GPU they hold the rank's CUDA file descriptors, so the rank's
device memory was not freed: on an H200 the next experiment failed with "Process N has 137.96 GiB
memory in use". So the rank ends its descendants first, and reaps them.

os._exit and SIGKILL also skip the finalizer that removes multiprocessing's pymp-* directory, where
a DataLoader worker that shares tensors keeps its socket: every such launch left one per worker in
/tmp. The rank removes its own, and those whose sockets its descendants were listening on.
"""

from __future__ import annotations

import os
import shutil
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
    left_behind = _multiprocessing_dirs_of(descendants)
    for process in descendants:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=timeout_s)
    for path in left_behind:
        shutil.rmtree(path, ignore_errors=True)


def _multiprocessing_dirs_of(processes: list[psutil.Process]) -> set[str]:
    """The pymp-* directories holding the sockets these processes listen on, less the one this
    process has (its own, or inherited through fork from its parent: a forked worker puts its
    socket there too, and the directory is not ours to remove)."""
    from multiprocessing import process as mp_process

    inherited = mp_process.current_process()._config.get("tempdir")  # noqa: SLF001 - get_temp_dir's cache
    found = set()
    for process in processes:
        try:
            listing = getattr(process, "net_connections", None) or process.connections  # psutil < 6
            sockets = listing(kind="unix")
        except Exception:  # noqa: BLE001 - a clean-up on the way out: never in the rank's way
            continue
        for sock in sockets:
            folder = os.path.dirname(sock.laddr) if isinstance(sock.laddr, str) else ""
            if os.path.basename(folder).startswith("pymp-") and folder != inherited:
                found.add(folder)
    return found


def remove_multiprocessing_temp_dir() -> None:
    """Run the finalizer multiprocessing registered for this process's temporary directory (it
    checks the pid, so a directory inherited through fork is left to its owner)."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    for finalizer in list(util._finalizer_registry.values()):  # noqa: SLF001 - the one os._exit skips
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:  # noqa: SLF001
            try:
                finalizer()
            except OSError:
                pass


def leave_now(status: int = 0) -> None:
    """Flush, end what this rank started, remove what it left in /tmp, and exit without
    interpreter teardown."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    end_descendants()
    remove_multiprocessing_temp_dir()
    os._exit(status)
