"""Run a LaunchPlan through torch elastic's launcher API and return the worst rank's exit status.

torch elastic starts each rank in its own session and, on SIGINT/SIGTERM or a failed
rank, kills every rank's process group before returning.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile

from autotuner.errors import UsageError
from autotuner.launch.plan import LaunchPlan
from autotuner.rank_setup import ERROR_DIR_ENV, read_rank_error

logger = logging.getLogger(__name__)


def exit_status(exitcode: int) -> int:
    """Shell convention: a rank killed by signal N reports 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run_plan(plan: LaunchPlan, *, quiet: bool = True) -> int:
    """Start the plan's ranks, wait for them, and return the worst exit status (0 when all succeed)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
    os.environ.update(plan.env)
    log_dir = tempfile.mkdtemp(prefix="autotuner-elastic-")
    error_dir = os.path.join(log_dir, "rank_errors")
    if quiet:
        os.makedirs(error_dir)
        os.environ[ERROR_DIR_ENV] = error_dir
    else:
        os.environ.pop(ERROR_DIR_ENV, None)
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
    )
    program, *args = plan.command
    try:
        elastic_launch(config, program)(*args)
        return 0
    except ChildFailedError as failed:
        first_rank, first = failed.get_first_failure()
        ours = read_rank_error(error_dir, first_rank) if quiet else None
        if ours is not None:
            print(f"launcher: error: rank {ours.rank}: {ours.message}", file=sys.stderr)
            return ours.exit_code
        for rank, failure in sorted(failed.failures.items()):
            print(f"launcher: rank {rank} exited with status {exit_status(failure.exitcode)}", file=sys.stderr)
        # The first rank to fail is the cause; the others were usually stopped by the agent (SIGTERM).
        print(f"launcher: rank {first_rank} failed first", file=sys.stderr)
        return exit_status(first.exitcode) or 1
    except SignalException as interrupted:
        print(f"launcher: stopped by {signal.Signals(interrupted.sigval).name}; all ranks ended", file=sys.stderr)
        return 128 + int(interrupted.sigval)
    except KeyboardInterrupt:
        print("launcher: interrupted; all ranks ended", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(log_dir, ignore_errors=True)
