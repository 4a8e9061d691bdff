"""A rank dies with the process that started it (Linux), so a killed launcher leaves no orphans.

Every rank sets this as it starts: torch elastic's ranks in autotuner.launch.run_script (a
tuner's launches, whichever engine the script trains on) and in our engine's init_distributed
(plain launches), warm ranks when forked. The flag survives exec, not fork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    # The parent may have died before prctl took effect: then we were reparented already.
    if os.getppid() != parent or parent == 1:
        os._exit(1)
