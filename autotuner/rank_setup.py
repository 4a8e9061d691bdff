"""What `import autotuner` sets up in a rank our launcher started: our errors reach the user as
one line from the launcher, not a traceback from every rank, and warnings print once per job.

The launcher names a directory in AUTOTUNER_ERROR_DIR. A rank whose uncaught exception is one of
ours (a config error found by `initialize()`, say) records it there and exits with the error's
status without a traceback; the launcher prints the first failing rank's line. Under `--debug`
the variable is not set, so tracebacks print as usual. No torch import: this runs at
`import autotuner` in every rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV = "AUTOTUNER_ERROR_DIR"
CONFIG_CHECKED_ENV = "AUTOTUNER_CONFIG_CHECKED"


def setup_rank() -> None:
    quiet_repeated_warnings()
    install_rank_excepthook()


def quiet_repeated_warnings() -> None:
    """The launcher printed the config's warnings already, and ranks other than 0 would repeat
    rank 0's: the config loader's warnings are then silenced in this process."""
    if os.environ.get(CONFIG_CHECKED_ENV) or os.environ.get("RANK", "0") != "0":
        logging.getLogger("autotuner.config").setLevel(logging.ERROR)


@dataclass(frozen=True)
class RankError:
    rank: int
    kind: str
    message: str
    exit_code: int

    def to_json(self) -> dict:
        return {"rank": self.rank, "kind": self.kind, "message": self.message, "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, data: dict) -> "RankError":
        return cls(int(data["rank"]), str(data["kind"]), str(data["message"]), int(data["exit_code"]))


def install_rank_excepthook() -> None:
    """In a rank started by our launcher: record our own errors and exit without a traceback."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory or getattr(sys.excepthook, "autotuner_rank_errors", False):
        return
    previous = sys.excepthook

    def hook(kind, err, traceback):
        from autotuner.atomic import write_json_atomic
        from autotuner.errors import AutotunerError

        if not isinstance(err, AutotunerError):
            previous(kind, err, traceback)
            return
        rank = int(os.environ.get("RANK", 0))
        record = RankError(rank, type(err).__name__, str(err), err.exit_code)
        try:
            write_json_atomic(Path(directory) / f"rank{rank}.json", record.to_json())
        except OSError:
            previous(kind, err, traceback)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # Straight out: an interpreter teardown could wait on process-group threads.
        os._exit(err.exit_code)

    hook.autotuner_rank_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def read_rank_error(directory: str | os.PathLike, rank: int | None) -> RankError | None:
    """The error `rank` recorded, else the lowest rank's, else None."""
    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if rank is not None:
        files = sorted(files, key=lambda p: p.stem != f"rank{rank}")
    for path in files:
        try:
            return RankError.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue
    return None
