"""What a rank that died abruptly left in its process group, ended once its launch is over.

Each rank runs in a session of its own (torch elastic starts it with start_new_session; a warm rank
calls setsid). A rank killed outright (the OOM killer, a segfault, SIGKILL) leaves its children
behind: DataLoader workers, inductor's compile workers, a script's own subprocesses. Reparented,
they are no longer under the launcher, and torch elastic signals only ranks still running. They
are still in the rank's process group, so that is where they are found and ended: after a torch
elastic launch that failed or was stopped (after one that succeeded, what a rank left in its
session is its own, as torchrun leaves it), and after every warm measurement launch. Elastic's
ranks are found by watching the launcher's children (a rank imports torch for seconds before it
can start anything); warm ranks are known by pid from their fork (they start in milliseconds).

A group id is the leader's pid, and Linux does not hand a pid out again while any process is in a
group of that id; so while the leader's pid is free, every process in the group is the rank's.
A live process with the leader's pid but another start time is a new process: its group is left
alone.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import psutil

# Ranks start together (no restarts): look often until they are seen and whenever they change,
# rarely otherwise, so a training run of hours pays nothing for the watch (each look scans the
# process table).
FIRST_WATCH_INTERVAL_S = 0.1
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


def group_of_rank(pid: int) -> RankGroup:
    """The group a rank started by us leads (or is about to: a warm rank calls setsid first thing),
    known by its pid from the start, so a rank that dies at once is not missed."""
    try:
        return RankGroup(pid, psutil.Process(pid).create_time())
    except psutil.Error:
        return RankGroup(pid, None)  # gone already: its pid is free unless its group lives on


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE  # a zombie holds nothing; its reaper may never come
    except psutil.Error:
        return False


def members(pgids: set[int]) -> list[psutil.Process]:
    """Live processes in these groups."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in pgids and _alive(process):
                found.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def end_rank_groups(groups: Iterable[RankGroup], wait_s: float = REAP_WAIT_S) -> list[psutil.Process]:
    """SIGKILL every process left in these groups, wait for them to go, and return those ended.
    Each is signalled as itself (psutil checks its start time first), never the group by id: a
    group id that has just been freed could name a new session by the time a killpg went out."""
    ours = os.getpgrp()
    pgids = {group.pgid for group in groups if group.pgid != ours and _still_the_rank_or_gone(group)}
    ended: list[psutil.Process] = []
    for _ in range(2):  # again for what a member forked as the first round went out
        left = [process for process in members(pgids) if process not in ended] if pgids else []
        if not left:
            break
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass
        ended += left
    deadline = time.monotonic() + wait_s
    while any(_alive(process) for process in ended) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ended


class GroupWatch:
    """The groups the ranks of one launch lead, noted while it runs."""

    def __init__(self, parent: int):
        self.parent = parent
        self.seen: dict[int, RankGroup] = {}
        self.sweep = True
        # Only what the launch starts: the caller's other children (a Ray node, say) are not ranks.
        self._before = {(group.pgid, group.started) for group in _groups_of_children(parent)}

    def note(self) -> bool:
        """Note new groups; whether there were any."""
        new = False
        for group in _groups_of_children(self.parent):
            if group.pgid not in self.seen and (group.pgid, group.started) not in self._before:
                self.seen[group.pgid] = group
                new = True
        return new

    def succeeded(self) -> None:
        """The launch ended well: what its ranks left in their sessions is theirs (an upload a rank
        started at its end, say), and is left alone, as torchrun leaves it."""
        self.sweep = False


def _groups_of_children(parent: int) -> list[RankGroup]:
    try:
        children = psutil.Process(parent).children()
    except psutil.Error:
        return []
    return [group for child in children if (group := group_led_by(child)) is not None]


@contextmanager
def children_groups_ended(parent_pid: int) -> Iterator[GroupWatch]:
    """While the block runs, note every group a child of `parent_pid` leads; after it, unless the
    block said the launch `succeeded()`, end what is left in them. For launches whose ranks are
    started and reaped out of our sight (torch elastic's, the forkserver's)."""
    watch = GroupWatch(parent_pid)
    stop = threading.Event()

    def look() -> None:
        interval = FIRST_WATCH_INTERVAL_S
        while not stop.wait(interval):
            if watch.note() or not watch.seen:
                interval = FIRST_WATCH_INTERVAL_S
            else:
                interval = min(LAST_WATCH_INTERVAL_S, interval * 1.5)

    watcher = threading.Thread(target=look, name="rank-groups", daemon=True)
    watcher.start()
    try:
        yield watch
    finally:
        stop.set()
        watcher.join()
        if watch.sweep:
            end_rank_groups(watch.seen.values())
