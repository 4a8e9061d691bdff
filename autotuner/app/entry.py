"""The launcher's entry point (`launcher`, `python -m autotuner`).

Until the stop guard is in place (`cli.main` installs it), a SIGINT or SIGTERM ends the process
at once with 128 + signal: nothing has been started or written yet, so there is nothing to end.
Without this, a Ctrl-C during the imports raises KeyboardInterrupt inside whatever module is
loading, which prints a traceback, or is swallowed by a library and the run goes on.
"""

from __future__ import annotations

import os
import signal


def _exit_at_once(signum: int, frame) -> None:
    os._exit(128 + signum)


def main() -> int:
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _exit_at_once)
    from autotuner.app.cli import main as launcher_main

    return launcher_main()
