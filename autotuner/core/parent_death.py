"""A process dies with the process that started it (Linux), so a killed launcher leaves no orphans.

Set as each process starts, before anything that can block:
- torch elastic's ranks (autotuner.launch.run_script; our engine's init_distributed for plain
  launches), with SIGKILL: the rank's parent is the launcher, named by LAUNCHED_BY_PID_ENV;
- warm ranks when forked, with SIGKILL, their parent being the tuner's forkserver;
- the forkserver itself, with SIGKILL, its parent being the tuner;
- a tuner's cold launcher (`--report_file`), with SIGTERM, so that it ends its ranks and removes
  its temporary files before it exits.

The flag survives exec, not fork. The parent may already have died when the flag is set; the
process then finds it has been re-parented and exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# The pid of the process that started this one (a launcher sets it for what it starts).
LAUNCHED_BY_PID_ENV = "AUTOTUNER_LAUNCHED_BY_PID"


def die_with_parent(expected_parent: int | None = None, death_signal: int = signal.SIGKILL) -> None:
    """Have the kernel send `death_signal` when the parent exits. `expected_parent` (default: the
    LAUNCHED_BY_PID_ENV variable, else the current parent) is checked after the flag is set: a
    different parent means it died first, and this process exits."""
    if not sys.platform.startswith("linux"):
        return
    if expected_parent is None:
        named = os.environ.get(LAUNCHED_BY_PID_ENV, "")
        expected_parent = int(named) if named.isdigit() else os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(death_signal))
    except (OSError, AttributeError):
        return
    if os.getppid() != expected_parent or expected_parent == 1:
        os._exit(128 + int(death_signal))
