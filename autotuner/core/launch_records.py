"""How a launch ended, as records written beside it: each rank's uncaught error (RankError, one
file a rank in the launch's error directory, ERROR_DIR_ENV) and the launcher's report of the job
(LaunchReport). Split from boundary.py, whose versioning they share. Plain data."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.core.boundary import VERSION, _check_version

PLAIN_KINDS = ("argparse", "SystemExit")  # RankError kinds whose message is the whole line
MESSAGE_LIMIT = 1000  # characters of a rank's error message kept in its record


def error_message(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """A rank's exception message as one line: every line kept (the useful part of a library's
    message is often not its last line), joined by " | ", and bounded: head and tail around " ... "."""
    joined = " | ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())
    if len(joined) <= limit:
        return joined
    tail = limit // 4
    return f"{joined[:limit - tail - 5]} ... {joined[-tail:]}"


@dataclass(frozen=True)
class RankError:
    """A rank's uncaught exception: its class name, its message line and the exit status it left
    with. `time` orders ranks that raised (the first is the cause; later ones are often follow-on
    errors such as gloo's "Connection closed by peer")."""

    rank: int
    kind: str
    message: str
    exit_code: int
    time: float = 0.0
    ours: bool = False  # an AutotunerError: the launcher prints it as one line
    version: int = VERSION

    @property
    def line(self) -> str:
        """What the rank printed last: `Kind: message` for an exception, the message itself for an
        argparse usage error or a non-zero sys.exit."""
        if self.kind in PLAIN_KINDS:
            return self.message
        return f"{self.kind}: {self.message}" if self.message else self.kind

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RankError":
        _check_version(data, "rank error")
        return cls(int(data["rank"]), str(data["kind"]), str(data["message"]), int(data["exit_code"]),
                   float(data.get("time", 0.0)), bool(data.get("ours", False)))


@dataclass(frozen=True)
class LaunchReport:
    """How a launch ended, as the launcher saw it. `exit_code` is the job's (0 when every rank
    succeeded); for a failure, the rank that failed first, its own exit status (128 + N when
    signal N killed it) and its exception line when it raised one."""

    exit_code: int
    failed_rank: int | None = None
    rank_exit_status: int | None = None
    exception: str | None = None
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LaunchReport":
        _check_version(data, "launch report")
        return cls(int(data["exit_code"]), data.get("failed_rank"), data.get("rank_exit_status"),
                   data.get("exception"))


def rank_errors(directory: str | os.PathLike) -> list[RankError]:
    """Every rank's recorded error, the earliest first."""
    found = []
    for path in Path(directory).glob("rank*.json"):
        try:
            found.append(RankError.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda error: (error.time, error.rank))
