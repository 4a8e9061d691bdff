"""What `import autotuner` sets up in a rank our launcher started: our errors reach the user as
one line from the launcher, not a traceback from every rank, and the config loader's warnings
print once per job (rank 0).

The launcher names a directory in AUTOTUNER_ERROR_DIR. A rank's uncaught exception is recorded
there (a RankError), so the launcher and the tuner know which rank failed and why without reading
logs. One of our own (a config error found by `initialize()`, say) then exits with the error's
status without a traceback, and the launcher prints the first failing rank's line; under `--debug`
tracebacks print as usual. No torch import: this runs at `import autotuner` in every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from autotuner.core.errors import ERROR_DIR_ENV

if TYPE_CHECKING:
    from autotuner.core.launch_records import RankError

QUIET_ERRORS_ENV = "AUTOTUNER_QUIET_ERRORS"  # our errors exit as one line (unset under --debug)
CONFIG_CHECKED_ENV = "AUTOTUNER_CONFIG_CHECKED"


def setup_rank() -> None:
    quiet_repeated_warnings()
    install_rank_excepthook()


def quiet_repeated_warnings() -> None:
    """The launcher printed the config's warnings already, and ranks other than 0 would repeat
    rank 0's: the config loader's warnings are then silenced in this process."""
    if os.environ.get(CONFIG_CHECKED_ENV) or os.environ.get("RANK", "0") != "0":
        logging.getLogger("autotuner.config").setLevel(logging.ERROR)


_shown_config_warnings: set[str] = set()


@contextlib.contextmanager
def config_warnings_shown(in_code: bool):
    """A config built in code (initialize(config=dict)), which the launcher never saw: its loader's
    warnings print on rank 0 all the same, each text once in the process (a script making four
    engines from like dicts says each once)."""
    log = logging.getLogger("autotuner.config")
    if not in_code or os.environ.get("RANK", "0") != "0":
        yield
        return

    def first_time(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text in _shown_config_warnings:
            return False
        _shown_config_warnings.add(text)
        return True

    loader = logging.getLogger("autotuner.config.loader")  # filters apply where a record is logged
    level = log.level
    log.setLevel(min(level, logging.WARNING) if level else logging.NOTSET)
    loader.addFilter(first_time)
    try:
        yield
    finally:
        log.setLevel(level)
        loader.removeFilter(first_time)


def install_rank_excepthook() -> None:
    """In a rank started by our launcher: record any uncaught exception for the launcher (its class,
    its message and the exit status), so the failing rank and its error never have to be read out of
    logs. One of our own errors then exits with its status and, unless --debug, no traceback."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory or getattr(sys.excepthook, "autotuner_rank_errors", False):
        return
    previous = sys.excepthook
    quiet = os.environ.get(QUIET_ERRORS_ENV) == "1"

    def hook(kind, err, traceback):
        from autotuner.core.boundary import write_record
        from autotuner.core.launch_records import RankError, error_message
        from autotuner.core.errors import AutotunerError

        ours = isinstance(err, AutotunerError)
        exit_code = err.exit_code if ours else 1
        if isinstance(err, KeyboardInterrupt):
            exit_code = 128 + signal.SIGINT
        rank = int(os.environ.get("RANK", 0))
        record = RankError(rank, kind.__name__, error_message(str(err)), exit_code, time.time(), ours)
        try:
            write_record(Path(directory) / f"rank{rank}.json", record)
        except OSError:
            previous(kind, err, traceback)
            return
        if not (ours and quiet):
            previous(kind, err, traceback)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # Straight out: an interpreter teardown could wait on process-group threads.
        os._exit(exit_code)

    hook.autotuner_rank_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def read_rank_error(directory: str | os.PathLike, rank: int | None) -> RankError | None:
    """The error `rank` recorded, else the earliest one, else None."""
    from autotuner.core.launch_records import rank_errors

    errors = rank_errors(directory)
    own = [error for error in errors if error.rank == rank]
    return (own or errors or [None])[0]
