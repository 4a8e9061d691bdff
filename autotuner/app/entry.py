"""The launcher's entry point (`launcher`, `python -m autotuner`).

Until the stop guard is in place (`cli.main` installs it), a SIGINT or SIGTERM ends the process
at once with 128 + signal: nothing has been started or written yet, so there is nothing to end.
Without this, a Ctrl-C during the imports raises KeyboardInterrupt inside whatever module is
loading, which prints a traceback, or is swallowed by a library and the run goes on.
"""

from __future__ import annotations

import atexit
import io
import os
import signal
import sys
import threading


def _exit_at_once(signum: int, frame) -> None:
    os._exit(128 + signum)


def whole_lines() -> None:
    """Each line this process prints reaches its stream in one write. A stream that writes through
    (stderr always, stdout under -u, as the node agents run) takes print()'s text and its newline
    as two writes; srun, the agents and the ranks write to the same file, and a line of theirs
    landing between the two tears ours apart. Line buffering still sends every line at once."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=False, line_buffering=True)


def main() -> int:
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _exit_at_once)
    whole_lines()
    from autotuner.app.cli import main as launcher_main

    status = launcher_main()
    _exit_without_teardown(status)
    return status


def _exit_without_teardown(status: int) -> None:
    """Exit as the interpreter would, less its teardown of every module: with torch, pandas and
    matplotlib loaded that takes most of a second of each launcher run and does nothing we need.
    The atexit handlers still run (multiprocessing's finalizers remove our temporary directories,
    logging flushes its handlers). A live non-daemon thread is joined by a normal exit: left to it."""
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)
