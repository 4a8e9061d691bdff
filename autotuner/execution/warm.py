"""Warm launches: ranks forked from a forkserver that imported torch and the script's libraries
once, so an experiment costs its steps, not interpreter start-up.

The forkserver is multiprocessing's, started by torch.multiprocessing.start_processes with the
"forkserver" method; `set_forkserver_preload` names `autotuner.launch.warm_preload`, which
imports torch and the modules the script imports at top level (read from its source) plus
`autotuning.warm_preload`. The forkserver never touches a device, so every rank is a fresh process
that initialises CUDA itself. Each trial gets its own TCPStore, hosted here as torch elastic's
agent hosts one; ranks get exactly the (cmd, env) a cold launch would (`launch.plan.rank_launch`).

Fallback to cold launches, logged: when `autotuning.warm_start` is false; when the forkserver or
its preload fails or initialised CUDA; when a warm rank crashes (a crash signal, not an exception)
and the same trial launched cold does not.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from autotuner.core.boundary import ERROR_DIR_ENV, write_record
from autotuner.core.launch_records import LaunchReport
from autotuner.core.boundary import WARM_PRELOAD_ENV as PRELOAD_ENV
from autotuner.execution.cold import ColdRunner
from autotuner.execution.forkserver import Forkserver, WarmStartBroken
from autotuner.launch.elastic import exit_status, failure_lines, failure_report
from autotuner.launch.plan import build_plan, rank_launch
from autotuner.launch.rank_groups import end_rank_groups, group_of_rank
from autotuner.launch.stopping import GRACE_S, descendants, end_processes
from autotuner.launch.warm_rank import UNSAFE_FORK_EXIT, WarmRankSpec
from autotuner.launch.warm_rank import main as warm_rank_main
from autotuner.core.parent_death import LAUNCHED_BY_PID_ENV
from autotuner.core.rank_setup import QUIET_ERRORS_ENV
from autotuner.tuning.trials.trial import RANK_ERRORS_DIR, WARM_RANKS_FILE, Trial
from autotuner.execution.trial_launch import judge, launch_options, prepare, trial_environment
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.runner import OneSlot, Runner

POLL_S = 0.05


# A forked process that inherited state it should not have (threads, locks, a device) dies by one of
# these, where a fresh interpreter would not; SIGKILL and SIGTERM come from outside (the OOM killer).
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)


def _warm_specific(report: LaunchReport) -> bool:
    """A failure the warm path may have caused, so the trial is launched cold too: a rank found the
    forkserver had touched CUDA, or crashed with a signal of its own without raising."""
    status = report.rank_exit_status
    if status == UNSAFE_FORK_EXIT:
        return True
    return report.exception is None and status is not None and status - 128 in CRASH_SIGNALS


class WarmRunner(OneSlot):
    """Forks each trial's ranks from a preloaded forkserver; falls back to `ColdRunner`."""

    name = "warm"

    def __init__(self, script: str, extra_modules: tuple[str, ...] = (), report: Callable[[str], None] = print,
                 forkserver: Forkserver | None = None):
        """`forkserver`: one the launcher started early for this script (it preloads meanwhile);
        the runner owns it from here. Without one, the runner starts its own at the first launch."""
        super().__init__()
        self._report = report
        self._cold = ColdRunner()
        self._cold_only = False
        self._forkserver = forkserver or Forkserver(script, extra_modules)

    @property
    def _server_pid(self) -> int | None:
        return self._forkserver.pid

    # ----- one trial -----
    def run(self, trial: Trial) -> TrialResult:
        if self._cold_only:
            return self._cold.run(trial)
        try:
            result, report = self._run_warm(trial)
        except WarmStartBroken as broken:
            self._fall_back(f"{broken}")
            return self._cold.run(trial)
        if result.state is TrialState.FAILED and report is not None and _warm_specific(report):
            cold = self._cold.run(trial)
            if cold.state is not TrialState.FAILED:
                self._fall_back(f"{trial.experiment.name} failed warm ({result.error}) but not cold")
            return cold
        return result

    def _fall_back(self, why: str) -> None:
        self._report(f"warm start off: {why}; every launch from now on starts cold")
        self._cold_only = True
        self._stop_forkserver()  # it may hold a CUDA context the cold ranks need

    def _end_ranks(self) -> None:
        """End every process the forkserver has forked, and theirs: found by parentage, so a rank
        forked as a stop came (before its pid reached us) is ended too."""
        if self._server_pid is not None:
            end_processes(descendants(self._server_pid), GRACE_S)

    def _stop_forkserver(self) -> None:
        """Ranks first (the forkserver only exits once every process holding its pipe has), then
        the forkserver and its resource tracker."""
        self._end_ranks()
        self._forkserver.stop()

    def _run_warm(self, trial: Trial) -> tuple[TrialResult, LaunchReport | None]:
        import torch.multiprocessing as torch_mp
        from torch.distributed import TCPStore

        prepare(trial)
        environ = {**trial_environment(trial, dict(os.environ)), QUIET_ERRORS_ENV: "1",
                   ERROR_DIR_ENV: str(trial.directory / RANK_ERRORS_DIR)}
        environ.pop(PRELOAD_ENV, None)
        (trial.directory / RANK_ERRORS_DIR).mkdir(exist_ok=True)
        options = launch_options(trial)
        plan = build_plan(options, sys.executable, environ)
        for note in plan.notes:
            print(f"launcher: note: {note}", file=sys.stderr)
        stdout, stderr = trial.directory / "stdout.log", trial.directory / "stderr.log"
        stdout.write_bytes(b"")
        stderr.write_bytes(b"")
        self._forkserver.ready(self._report)
        # Hosted here, as elastic's agent hosts its store; the ranks connect as clients.
        store = TCPStore("127.0.0.1", options.master_port or 0, None, True, wait_for_workers=False)
        specs = []
        for local_rank in range(plan.nproc_per_node):
            command, env = rank_launch(plan, local_rank, "127.0.0.1", store.port, environ)
            env = {**env, LAUNCHED_BY_PID_ENV: str(self._server_pid)}  # a rank dies with the forkserver
            specs.append(WarmRankSpec(command, env, os.getcwd(), str(stdout), str(stderr), self._server_pid))
        (trial.directory / WARM_RANKS_FILE).write_text("".join(shlex.join(spec.command) + "\n" for spec in specs))
        started = time.monotonic()
        ranks: list = []  # their groups, known from the fork on
        try:
            try:
                context = torch_mp.start_processes(warm_rank_main, args=(tuple(specs),), nprocs=len(specs),
                                                   join=False, start_method="forkserver")
            except Exception as err:  # noqa: BLE001 - the forkserver is gone or refused
                raise WarmStartBroken(f"ranks could not be forked ({type(err).__name__}: {err})") from None
            ranks = [group_of_rank(process.pid) for process in context.processes]
            timed_out, statuses, first_failed = self._wait(context, trial.settings.timeout_s, started)
        finally:
            # Every rank the forkserver forked, also one forked as a stop came (its pid not yet ours).
            self._end_ranks()
            # What a rank killed outright left in its session (reparented, no longer a descendant).
            end_rank_groups(ranks)
            del store
        wall = time.monotonic() - started
        if timed_out:
            return judge(trial, None, True, wall), None
        if first_failed is None:
            report = LaunchReport(exit_code=0)
        else:
            error_dir = str(trial.directory / RANK_ERRORS_DIR)
            report = failure_report(error_dir, first_failed, statuses)
            with open(stderr, "a") as log:  # as the cold launcher prints them
                log.writelines(line + "\n" for line in failure_lines(error_dir, report, statuses, quiet=True))
        write_record(trial.report_path, report)
        return judge(trial, report.exit_code, False, wall), report

    def _wait(self, context, timeout_s: float, started: float) -> tuple[bool, dict[int, int], int | None]:
        """Until every rank has exited, one has failed (then the rest are ended, as elastic's agent
        does), or the time limit. Returns (timed out, exit status per rank, first failed rank)."""
        processes = context.processes
        first_failed = None
        while True:
            for index, process in enumerate(processes):
                if process.exitcode not in (None, 0) and first_failed is None:
                    first_failed = index
            if first_failed is not None or all(p.exitcode is not None for p in processes):
                break
            if time.monotonic() - started > timeout_s:
                return True, {}, None
            multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=POLL_S)
        if first_failed is not None:
            self._end_ranks()
        for process in processes:
            process.join(timeout=GRACE_S)
        statuses = {index: exit_status(p.exitcode if p.exitcode is not None else -signal.SIGKILL)
                    for index, p in enumerate(processes)}
        return False, {rank: status for rank, status in statuses.items() if status != 0}, first_failed

    def train(self, options, quiet: bool) -> int:
        """The user's job to its end starts cold: seconds saved are nothing there, and it gets torch
        elastic's full agent. The forkserver is stopped first, so it holds no memory meanwhile."""
        self._stop_forkserver()
        return self._cold.train(options, quiet)

    def close(self) -> None:
        try:
            self._end_ranks()
        finally:
            self._forkserver.close()


@contextmanager
def make_runner(tuning, settings, report: Callable[[str], None],
                forkserver: Forkserver | None = None) -> Iterator[Runner]:
    """The runner a tuning run uses: warm unless `autotuning.warm_start` is false (`forkserver`:
    one started early for it, stopped here whichever runner is made)."""
    if not tuning.warm_start:
        report("warm start off (autotuning.warm_start: false): each experiment starts cold")
        runner: Runner = ColdRunner()
    else:
        runner = WarmRunner(settings.script, tuple(tuning.warm_preload), report, forkserver)
        forkserver = None
    try:
        yield runner
    finally:
        try:
            runner.close()
        finally:
            if forkserver is not None:
                forkserver.close()
