"""What a rank that died abruptly left in its process group, ended once its launch is over.

Each rank runs in a session of its own (torch elastic starts it with start_new_session; a warm rank
calls setsid). A rank killed outright (the OOM killer, a segfault, SIGKILL) leaves its children
behind: DataLoader workers, inductor's compile workers, a script's own subprocesses. Reparented,
they are no longer under the launcher, and torch elastic signals only ranks still running. They
are still in the rank's process group, so that is where they are found and ended.

A group id is the leader's pid, and Linux does not hand a pid out again while any process is in a
group of that id; so while the leader's pid is free, every process in the group is the rank's.
A live process with the leader's pid but another start time is a new process: its group is left
alone.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import psutil

# Ranks start together at the launch's start (no restarts): look often then, rarely later, so a
# training run of hours pays nothing for the watch (each look scans the process table).
FIRST_WATCH_INTERVAL_S = 0.05
LAST_WATCH_INTERVAL_S = 5.0
REAP_WAIT_S = 5.0


@dataclass(frozen=True)
class RankGroup:
    pgid: int  # the rank's pid: it leads its own group
    started: float | None  # the rank's start time (psutil's), None when it was gone before it was seen


def group_led_by(process: psutil.Process) -> RankGroup | None:
    """The group `process` leads, or None when it leads none (or is gone)."""
    try:
        if os.getpgid(process.pid) != process.pid:
            return None
        return RankGroup(process.pid, process.create_time())
    except (psutil.Error, ProcessLookupError, PermissionError):
        return None


def _still_the_rank_or_gone(group: RankGroup) -> bool:
    try:
        leader = psutil.Process(group.pgid)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    try:
        return group.started is not None and abs(leader.create_time() - group.started) < 0.01
    except psutil.Error:
        return True


def members(pgids: set[int]) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in pgids:
                found.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def end_rank_groups(groups: Iterable[RankGroup], wait_s: float = REAP_WAIT_S) -> list[psutil.Process]:
    """SIGKILL every process left in these groups, wait for them to go, and return those ended."""
    ours = os.getpgrp()
    pgids = {group.pgid for group in groups if group.pgid != ours and _still_the_rank_or_gone(group)}
    if not pgids:
        return []
    left = members(pgids)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    psutil.wait_procs(left, timeout=wait_s)
    return left


def _groups_of_children(parent: int) -> list[RankGroup]:
    try:
        children = psutil.Process(parent).children()
    except psutil.Error:
        return []
    return [group for child in children if (group := group_led_by(child)) is not None]


@contextmanager
def children_groups_ended(parent_pid: int | None = None) -> Iterator[None]:
    """While the block runs, note every group a child of `parent_pid` (default: this process)
    leads; after it, end what is left in them. For torch elastic's launch, whose ranks are children
    of this process that it starts and reaps out of our sight."""
    seen: dict[int, RankGroup] = {}
    stop = threading.Event()
    parent = parent_pid or os.getpid()
    # Only what the block starts: the caller's other children (a Ray node, say) are not ranks.
    before = {(group.pgid, group.started) for group in _groups_of_children(parent)}

    def note_children() -> None:
        for group in _groups_of_children(parent):
            if group.pgid not in seen and (group.pgid, group.started) not in before:
                seen[group.pgid] = group

    def watch() -> None:
        interval = FIRST_WATCH_INTERVAL_S
        while not stop.wait(interval):
            note_children()
            interval = min(LAST_WATCH_INTERVAL_S, interval * 1.5)

    watcher = threading.Thread(target=watch, name="rank-groups", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        end_rank_groups(seen.values())
