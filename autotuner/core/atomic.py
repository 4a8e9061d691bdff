"""Atomic file writes shared by every stage (no torch import, so the tuner stays light)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON so a reader sees the old file or the whole new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sweep_partial_writes(directory: str | os.PathLike) -> None:
    """Remove the temporary files of writes that never finished (a process killed outright while
    writing): `.NAME.XXXX.tmp` at any depth. Only for a directory no other process writes now."""
    for leftover in Path(directory).rglob(".*.tmp"):
        leftover.unlink(missing_ok=True)
