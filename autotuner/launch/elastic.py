"""Run a LaunchPlan through torch elastic's launcher API and return the worst rank's exit status.

torch elastic starts each rank in its own session and, on SIGINT/SIGTERM or a failed
rank, kills every rank's process group before returning. A stop then goes up as `Stopped`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from autotuner.core.errors import UsageError
from autotuner.launch.plan import LaunchPlan
from autotuner.launch.rank_entry import LOG_PREFIX_ENV, log_prefix
from autotuner.launch.rank_groups import children_groups_ended
from autotuner.launch.stopping import (GRACE_S, Stopped, install_stop_handlers, make_temporary_dir,
                                       remove_temporary_dir)
from autotuner.core.parent_death import LAUNCHED_BY_PID_ENV
from autotuner.core.boundary import ERROR_DIR_ENV, write_record
from autotuner.core.launch_records import LaunchReport, rank_errors
from autotuner.core.rank_setup import QUIET_ERRORS_ENV, read_rank_error

logger = logging.getLogger(__name__)


def exit_status(exitcode: int) -> int:
    """Shell convention: a rank killed by signal N reports 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_plan(plan: LaunchPlan, *, quiet: bool = True) -> int:
    """Start the plan's ranks, wait for them, and return the worst exit status (0 when all succeed).
    A stop (SIGINT/SIGTERM) ends the ranks and raises `Stopped`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return _run_plan(plan, quiet)
    except SignalException as late:  # elastic's handler fired outside the launch (in our reporting)
        raise Stopped(int(late.sigval)) from None


def _run_plan(plan: LaunchPlan, quiet: bool) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous import RendezvousError

    if quiet:
        # We print one line per failed rank ourselves; elastic's own report repeats it at length.
        # Its modules set their loggers' levels themselves, so each one is quieted.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    for note in plan.notes:
        print(f"launcher: note: {note}", file=sys.stderr)
    if plan.each_rank_log_dir is not None:
        try:
            os.makedirs(plan.each_rank_log_dir, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--enable_each_rank_log: cannot create {plan.each_rank_log_dir} "
                             f"({err.strerror}); give a writable directory") from None
        os.environ[LOG_PREFIX_ENV] = log_prefix()
    os.environ.update(plan.env)
    os.environ[LAUNCHED_BY_PID_ENV] = str(os.getpid())  # each rank dies with this process (parent_death)
    log_dir = make_temporary_dir("elastic")
    error_dir = os.path.join(log_dir, "rank_errors")
    os.makedirs(error_dir)
    os.environ[ERROR_DIR_ENV] = error_dir  # every rank's uncaught exception is recorded there
    if quiet:
        os.environ[QUIET_ERRORS_ENV] = "1"
    else:
        os.environ.pop(QUIET_ERRORS_ENV, None)
    config = LaunchConfig(
        min_nodes=plan.num_nodes,
        max_nodes=plan.num_nodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.run_id,
        rdzv_backend=plan.rdzv_backend,
        rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_configs=dict(plan.rdzv_configs),
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=plan.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        # SIGTERM, then SIGKILL after our grace period: within the launcher's stop bound.
        **({"shutdown_timeout": int(GRACE_S)} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}),
    )
    program, *args = plan.command
    report = LaunchReport(exit_code=1)
    stopped = None
    if plan.num_nodes > 1:
        who = (f"node {plan.rdzv_configs['rank']} of {plan.num_nodes}" if plan.rdzv_backend == "static"
               else f"one of {plan.num_nodes} nodes")
        print(f"launcher: {who}: waiting for every node at {plan.rdzv_endpoint} ({plan.rdzv_backend} rendezvous)",
              file=sys.stderr, flush=True)
    try:
        with children_groups_ended(os.getpid()) as ranks:  # what a rank killed outright left behind
            elastic_launch(config, program)(*args)
            ranks.succeeded()
        report = LaunchReport(exit_code=0)
    except (RendezvousError, DistStoreError) as failed:
        # No traceback: which rendezvous failed and what the nodes must agree on.
        first = str(failed).strip().splitlines()[-1] if str(failed).strip() else type(failed).__name__
        print(f"launcher: error: {plan.rdzv_backend} rendezvous at {plan.rdzv_endpoint} with {plan.num_nodes} "
              f"node(s) failed: {first}; every node must start with the same --num_nodes and "
              + ("--master_addr/--master_port" if plan.rdzv_backend == "static" else "--rdzv_endpoint/--rdzv_id")
              + " (timeout: --rdzv_conf timeout=SECONDS, or join_timeout for c10d)", file=sys.stderr)
        if not quiet:
            traceback.print_exc()
        report = LaunchReport(exit_code=1)
    except ChildFailedError as failed:
        first_rank, first = failed.get_first_failure()
        report = failure_report(error_dir, first_rank, {rank: exit_status(f.exitcode)
                                                        for rank, f in failed.failures.items()})

        statuses = {rank: exit_status(f.exitcode) for rank, f in failed.failures.items()}
        for line in failure_lines(error_dir, report, statuses, quiet):
            print(line, file=sys.stderr)
    except (SignalException, Stopped) as interrupted:
        # torch elastic's handler (during the launch) or ours (before it, in rendezvous) raised;
        # elastic has ended its ranks either way. One kind of stop goes up from here.
        signum = int(interrupted.sigval) if isinstance(interrupted, SignalException) else interrupted.signum
        print(f"launcher: stopped by {signal.Signals(signum).name}; all ranks ended", file=sys.stderr, flush=True)
        report = LaunchReport(exit_code=128 + signum)
        stopped = Stopped(signum, reported=True)
    finally:
        install_stop_handlers()  # elastic replaced them with its own
        os.environ.pop(ERROR_DIR_ENV, None)
        os.environ.pop(QUIET_ERRORS_ENV, None)
        if plan.report_file:
            write_record(plan.report_file, report)
        remove_temporary_dir(log_dir)
    if stopped is not None:
        raise stopped
    return report.exit_code


def failure_lines(error_dir: str, report: LaunchReport, statuses: dict[int, int], quiet: bool) -> list[str]:
    """What the launcher prints about a failed launch: our own error as one line, else each failed
    rank's status and which failed first."""
    ours = read_rank_error(error_dir, report.failed_rank)
    if quiet and ours is not None and ours.ours and ours.rank == report.failed_rank:
        return [f"launcher: error: rank {ours.rank}: {ours.message}"]
    return [*(f"launcher: rank {rank} exited with status {status}" for rank, status in sorted(statuses.items())),
            f"launcher: rank {report.failed_rank} failed first"]


def failure_report(error_dir: str, first_failed: int, statuses: dict[int, int]) -> LaunchReport:
    """The rank that failed first and why, from the ranks' own records. The first rank seen to fail
    is the cause, with its recorded exception when it raised one. When that rank was only stopped
    (SIGTERM, as the launcher stops peers), the earliest rank that raised is the cause instead.
    A rank that raised after a peer died (gloo's "Connection closed by peer") is never preferred
    to that peer."""
    records = {error.rank: error for error in reversed(rank_errors(error_dir)) if error.rank in statuses}
    cause = records.get(first_failed)
    if cause is None and records and statuses.get(first_failed) == 128 + signal.SIGTERM:
        cause = min(records.values(), key=lambda error: error.time)
    if cause is None:
        status = statuses.get(first_failed, 1)
        return LaunchReport(status or 1, first_failed, status, None)
    status = statuses[cause.rank]
    return LaunchReport(cause.exit_code if cause.ours else (status or 1), cause.rank, status, cause.line)
