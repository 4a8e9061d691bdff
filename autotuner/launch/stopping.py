"""How every launcher process stops: on SIGINT/SIGTERM, on a second Ctrl-C, and when its stop overruns.

- The first SIGINT or SIGTERM raises `Stopped` in the main thread, once: the launch being run
  unwinds, and each level ends what it started (ranks, forkserver, nodes) on the way out.
  Later signals raise nothing, so no clean-up is cut short half-way.
- A second SIGINT/SIGTERM ends everything at once: every descendant of this process gets
  SIGKILL, the temporary directories registered here are removed, and the process exits
  128 + signal, as a second Ctrl-C does with torchrun.
- A stop that has not finished `HARD_STOP_AFTER_S` after the first signal is finished the same
  way, so a user's Ctrl-C is answered within STOP_BOUND_S whatever was running.

The second signal and the deadline are seen by a watcher thread through `signal.set_wakeup_fd`,
which the interpreter writes for every handled signal whoever's Python handler runs: torch
elastic installs its own handlers during a launch, and the guard still sees its signals.

Processes are found by parentage (psutil), never by name; a rank in a session of its own is
still its parent's child. Everything is ended by SIGTERM to the process and its own process group,
then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import psutil

GRACE_S = 10.0  # a rank's time to end after SIGTERM, before SIGKILL
STOP_BOUND_S = 15.0  # what a user waits at most after Ctrl-C
HARD_STOP_AFTER_S = STOP_BOUND_S - 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
TEMP_PREFIX = "autotuner-"


class Stopped(BaseException):
    """SIGINT or SIGTERM reached this launcher; raised once so every level ends what it started."""

    def __init__(self, signum: int, reported: bool = False):
        super().__init__(signum)
        self.signum = signum
        self.reported = reported  # a level below has printed what it stopped

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


# ----- ending processes -----
def _tree(processes: Iterable[psutil.Process]) -> dict[int, psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for process in processes:
        try:
            found[process.pid] = process
            for child in process.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return found


def _ignores(pid: int, sig: int) -> bool:
    """Whether the process ignores `sig` (multiprocessing's resource tracker ignores SIGTERM)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next((line.split()[1] for line in status if line.startswith("SigIgn:")), "0")
        return bool(int(mask, 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        return False


def _signal_all(processes: Iterable[psutil.Process], sig: int) -> None:
    """Each process exactly once: a process-group leader (a rank's session) through its group, so
    what it started in the group goes too, and every other process directly. Once matters: our
    launchers take a second SIGTERM as "stop at once". A process that ignores SIGTERM gets SIGKILL
    at once: waiting out a grace period is pointless."""
    processes = list(processes)
    ours = os.getpgrp()
    groups = set()
    for process in processes:
        try:
            if os.getpgid(process.pid) == process.pid and process.pid != ours:
                groups.add(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL if sig == signal.SIGTERM and _ignores(group, sig) else sig)
        except (ProcessLookupError, PermissionError):
            pass
    for process in processes:
        try:
            if process.pid in groups or os.getpgid(process.pid) in groups:
                continue
            process.send_signal(signal.SIGKILL if sig == signal.SIGTERM and _ignores(process.pid, sig) else sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def end_processes(processes: Iterable[psutil.Process], grace_s: float = GRACE_S) -> None:
    """End these processes and everything under them: SIGTERM, then SIGKILL after `grace_s`.
    Descendants are collected again before each signal, so a child forked meanwhile is not missed."""
    tree = _tree(processes)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not tree:
            return
        _signal_all(tree.values(), sig)
        _, alive = psutil.wait_procs(list(tree.values()), timeout=wait_s)
        tree = _tree(alive)
    _signal_all(tree.values(), signal.SIGKILL)  # forked after the SIGKILL round
    psutil.wait_procs(list(tree.values()), timeout=5.0)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def end_descendants(grace_s: float = GRACE_S) -> None:
    """End every process this one started, and theirs."""
    end_processes(descendants(), grace_s)


# ----- temporary directories that a hard stop removes, and a later start sweeps -----
_temporary: set[str] = set()


# A socket's path (sun_path) holds 107 bytes. multiprocessing puts the forkserver's socket,
# "listener-XXXXXXXX", in its temporary directory; under a long TMPDIR (a CI job's, a test's) it
# cannot be bound there. Python 3.13's multiprocessing then falls back to these directories; we do too.
SOCKET_PATH_MAX = 107
SHORT_TEMP_ROOTS = ("/tmp", "/var/tmp", "/usr/tmp")
_SOCKET_NAME_ROOM = len("/listener-XXXXXXXX")


def make_temporary_dir(kind: str, holds_sockets: bool = False) -> str:
    """A directory named autotuner-KIND-PID-XXXX in the temporary directory; `remove_temporary_dir`
    removes it. One left by a killed launcher is removed by the next launcher's start. With
    `holds_sockets`, a temporary directory too long for a socket's path is passed over for a short one."""
    prefix = f"{TEMP_PREFIX}{kind}-{os.getpid()}-"
    root = None
    if holds_sockets:
        room = SOCKET_PATH_MAX - _SOCKET_NAME_ROOM - len(prefix) - len("/XXXXXXXX")
        if len(tempfile.gettempdir()) > room:
            root = next((r for r in SHORT_TEMP_ROOTS if len(r) <= room and os.access(r, os.W_OK | os.X_OK)), None)
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    _temporary.add(path)
    return path


def remove_temporary_dir(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _temporary.discard(str(path))


def remove_temporary_dirs() -> None:
    """Every directory `make_temporary_dir` made and nobody removed: a stop cut its owner short."""
    for path in list(_temporary):
        remove_temporary_dir(path)


def sweep_stale_temporary_dirs() -> None:
    """Remove autotuner-KIND-PID-* directories whose launcher is gone (SIGKILL gives no chance to),
    in the temporary directory and in the short ones a socket's directory may have gone to."""
    for root in dict.fromkeys((tempfile.gettempdir(), *SHORT_TEMP_ROOTS)):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if not name.startswith(TEMP_PREFIX) or len(parts) < 4 or not parts[2].isdigit():
                continue
            if not psutil.pid_exists(int(parts[2])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ----- the guard -----
class _Guard:
    def __init__(self) -> None:
        self.raised = False  # the main thread's handler raised Stopped (once)
        self.signum = 0
        self.first_seen_at: float | None = None  # when the watcher saw the first stop signal
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.previous_wakeup = -1
        self.closed = threading.Event()
        self.work_started = False  # the run owns state (files being written, a Ray cluster's actors)

    def handler(self, signum, _frame) -> None:
        if not self.raised:
            self.raised = True
            self.signum = signum
            if not self.work_started and not descendants() and not _temporary:
                # Nothing started yet (imports, config checks): nothing to end, and an exception
                # raised inside a library's import can leave it half-initialised. Leave at once.
                _leave_now(signum)
            raise Stopped(signum)
        # A later signal: the watcher thread ends everything; raising here would cut a clean-up short.

    def watch(self) -> None:
        """Counts stop signals from the wakeup pipe, whoever's handler ran: the second one, or the
        deadline after the first, ends everything."""
        first: int | None = None
        while not self.closed.is_set():
            timeout = 0.5 if self.first_seen_at is None else max(
                0.0, self.first_seen_at + HARD_STOP_AFTER_S - time.monotonic())
            try:
                ready, _, _ = select.select([self.read_fd], [], [], timeout)
            except (OSError, ValueError):
                return
            if self.closed.is_set():
                return
            if ready:
                try:
                    received = os.read(self.read_fd, 64)
                except OSError:
                    continue
                for signum in (s for s in received if s in STOP_SIGNALS):
                    if first is None:
                        first, self.first_seen_at = signum, time.monotonic()
                    else:
                        hard_stop(signum, f"stopped by {signal.Signals(signum).name} again")
            elif first is not None and time.monotonic() >= self.first_seen_at + HARD_STOP_AFTER_S:
                hard_stop(first, f"stopping took over {HARD_STOP_AFTER_S:.0f} s")


_guard: _Guard | None = None


def hard_stop(signum: int, why: str) -> None:
    """SIGKILL every descendant, remove our temporary directories, exit 128 + signum. Never returns."""
    try:
        print(f"launcher: {why}; ending every process at once", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    for _ in range(3):  # a process forked while the first round ran is caught by the next
        tree = descendants()
        if not tree:
            break
        _signal_all(tree, signal.SIGKILL)
        psutil.wait_procs(tree, timeout=2.0)
    for path in list(_temporary):
        shutil.rmtree(path, ignore_errors=True)
    os._exit(128 + signum)


def _leave_now(signum: int) -> None:
    try:
        print(f"launcher: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    os._exit(128 + signum)


def stop_signal() -> int | None:
    """The signal that started a stop in progress, if one is."""
    if _guard is not None and _guard.raised:
        return _guard.signum
    return None


def raise_if_stopped() -> None:
    """Raise the stop in progress again. The handler's `Stopped` is lost when the signal lands in
    code that swallows exceptions (a weakref callback or `__del__` run by the garbage collector, a
    library's bare except); the loops that wait on launches call this so the stop still stands."""
    if (signum := stop_signal()) is not None:
        raise Stopped(signum)


def install_stop_handlers() -> None:
    """(Re)install the guard's handlers: torch elastic replaces them with its own during a launch."""
    if _guard is not None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _guard.handler)


@contextmanager
def stop_guard() -> Iterator[None]:
    """The launcher's whole run: the first SIGINT/SIGTERM raises `Stopped`, a second one or an
    overrun ends everything at once. Off the main thread (a launcher called from a thread) it
    does nothing: signals reach only the main thread."""
    global _guard
    if threading.current_thread() is not threading.main_thread() or _guard is not None:
        yield
        return
    guard = _Guard()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    _guard = guard
    install_stop_handlers()
    guard.previous_wakeup = signal.set_wakeup_fd(guard.write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=guard.watch, daemon=True, name="stop-guard")
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(guard.previous_wakeup)
        if not (guard.raised or guard.first_seen_at is not None):
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # After a stop, our handler stays: the process is on its way out with 128 + signal, and a
        # late second Ctrl-C must not turn that into a KeyboardInterrupt traceback at exit.
        guard.closed.set()
        os.write(guard.write_fd, b"\0")  # wake the watcher to see it is closed
        watcher.join(timeout=2.0)
        os.close(guard.read_fd)
        os.close(guard.write_fd)
        _guard = None


def mark_work_started() -> None:
    """From here on a stop unwinds even with no child process: the run writes its own files, or
    holds actors on a Ray cluster, which leaving at once would cut short (a half-written file)."""
    if _guard is not None:
        _guard.work_started = True


def stop_in_progress() -> bool:
    return _guard is not None and (_guard.raised or _guard.first_seen_at is not None)
