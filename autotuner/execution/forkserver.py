"""The warm path's forkserver: multiprocessing's, preloaded with torch and the modules the script
imports, so each rank forked from it skips interpreter start-up.

Kept free of torch on purpose: the launcher starts the forkserver before it imports torch itself,
and the two imports then run side by side instead of one after the other (about 2 s of every
tuning run's start on 2 cores). `WarmRunner` forks the ranks; this module only starts, checks and
stops the server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import psutil

from autotuner.core.boundary import WARM_PRELOAD_ENV as PRELOAD_ENV
from autotuner.core.boundary import WARM_PRELOAD_REPORT_ENV as REPORT_ENV
from autotuner.core.script_imports import script_imports
from autotuner.launch.stopping import make_temporary_dir, remove_temporary_dir
from autotuner.core.parent_death import LAUNCHED_BY_PID_ENV

POLL_S = 0.05
PRELOAD_TIMEOUT_S = 600.0


class WarmStartBroken(Exception):
    """The warm path cannot serve this run; the runner switches to cold launches."""


class Forkserver:
    """One preloaded forkserver: `start` returns at once (the preload runs in the server), `ready`
    waits for the preload's report and checks it, `stop` ends the server and its resource tracker.
    Each is idempotent, so whoever holds it last may stop it."""

    def __init__(self, script: str, extra_modules: tuple[str, ...] = ()):
        self.preload = (*script_imports(script), *extra_modules)
        self._scratch = make_temporary_dir("warm")
        self._report_path = Path(self._scratch) / "preload.json"
        self.pid: int | None = None
        self._ready = False

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        if self.running:
            return
        os.environ[PRELOAD_ENV] = json.dumps(list(self.preload))
        os.environ[REPORT_ENV] = str(self._report_path)
        os.environ[LAUNCHED_BY_PID_ENV] = str(os.getpid())  # the forkserver dies with this process
        _multiprocessing_temp_dir_of_ours()
        try:
            import multiprocessing
            from multiprocessing import forkserver

            # The forkserver takes this process's environment when it starts, and keeps it.
            multiprocessing.set_forkserver_preload(["__main__", "autotuner.launch.warm_preload"])
            forkserver.ensure_running()
        except Exception as err:  # noqa: BLE001
            raise WarmStartBroken(f"the forkserver did not start ({type(err).__name__}: {err})") from None
        finally:
            os.environ.pop(PRELOAD_ENV, None)
            os.environ.pop(REPORT_ENV, None)
            os.environ.pop(LAUNCHED_BY_PID_ENV, None)
        self.pid = forkserver._forkserver._forkserver_pid  # noqa: SLF001 - its pid, to watch it
        self._ready = False

    def ready(self, report: Callable[[str], None]) -> None:
        """Started and preloaded: waits for the preload's report, so a preload that touched CUDA is
        known before any rank is forked, and says what was preloaded (once)."""
        self.start()
        if self._ready:
            return
        deadline = time.monotonic() + PRELOAD_TIMEOUT_S
        while not self._report_path.exists():
            try:
                alive = self.pid is not None and psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                raise WarmStartBroken("the forkserver exited while preloading")
            if time.monotonic() > deadline:
                raise WarmStartBroken(f"preloading took over {PRELOAD_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        try:
            preload = json.loads(self._report_path.read_text())
        except (OSError, ValueError):
            raise WarmStartBroken("the forkserver's preload report is unreadable") from None
        if preload.get("cuda_initialized"):
            raise WarmStartBroken("importing the script's modules initialised CUDA in the forkserver")
        for name, error in preload.get("failed", {}).items():
            report(f"warm start: could not preload {name} ({error}); ranks import it themselves")
        report(f"warm start: forkserver preloaded {len(preload.get('loaded', []))} modules in "
               f"{preload.get('seconds', 0):.1f} s")
        self._report_path.unlink(missing_ok=True)
        self._ready = True

    def stop(self) -> None:
        """The forkserver, then the resource tracker, each waited for with a bound. The ranks it
        forked must be ended first: it only exits once every holder of its pipe has."""
        if not self.running:
            return
        self.pid = None
        self._ready = False
        from multiprocessing import forkserver

        server = forkserver._forkserver  # noqa: SLF001 - multiprocessing's _stop waits without a bound
        if server._forkserver_alive_fd is not None:  # noqa: SLF001
            os.close(server._forkserver_alive_fd)  # noqa: SLF001 - closing it asks the server to exit
            server._forkserver_alive_fd = None  # noqa: SLF001
        if server._forkserver_pid is not None:  # noqa: SLF001
            # It holds nothing to clean up (its ranks are ended), and an orderly exit tears torch
            # down for about a second; a kill ends it at once.
            try:
                os.kill(server._forkserver_pid, signal.SIGKILL)  # noqa: SLF001
            except ProcessLookupError:
                pass
            _reap(server._forkserver_pid)  # noqa: SLF001
            server._forkserver_pid = None  # noqa: SLF001
        address = server._forkserver_address  # noqa: SLF001
        server._forkserver_address = None  # noqa: SLF001
        if address and not address.startswith("\0") and os.path.exists(address):
            os.unlink(address)
        _stop_resource_tracker()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            remove_temporary_dir(self._scratch)


def _reap(pid: int, wait_s: float = 5.0) -> None:
    """Wait for a child of ours to exit, at most `wait_s`, then SIGKILL it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = float("inf")
            os.waitpid(pid, 0)
            return
        time.sleep(POLL_S)


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker, started for the forkserver, exits once every holder of
    its pipe has: the ranks and the forkserver are gone now, so closing ours ends it."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # noqa: SLF001
    with tracker._lock:  # noqa: SLF001
        if tracker._fd is None:  # noqa: SLF001
            return
        os.close(tracker._fd)  # noqa: SLF001
        tracker._fd = None  # noqa: SLF001
        if tracker._pid is not None:  # noqa: SLF001
            _reap(tracker._pid)  # noqa: SLF001
            tracker._pid = None  # noqa: SLF001


def _multiprocessing_temp_dir_of_ours() -> None:
    """multiprocessing keeps the forkserver's socket in a pymp-* directory that it removes at exit;
    one of ours instead, so a launcher killed outright leaves a directory the next start sweeps
    (and a short one where TMPDIR is too long for a socket's path: warm start keeps working)."""
    from multiprocessing import process

    config = process.current_process()._config  # noqa: SLF001 - where util.get_temp_dir caches it
    if config.get("tempdir") is None:
        path = make_temporary_dir("mp", holds_sockets=True)
        config["tempdir"] = path
        from multiprocessing import util

        util.Finalize(None, remove_temporary_dir, args=(path,), exitpriority=-100)
