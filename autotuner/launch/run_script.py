"""What each rank runs: the user's script, as `python script.py ARGS` would, with the default
process group ended after it returns and, in a tuner's launch, its failure recorded for the launcher.

    python -u -m autotuner.launch.run_script train.py --local_rank=0 ARGS

The script runs through runpy with `__name__ == "__main__"`, its own `sys.argv` and its
directory first on `sys.path`. An uncaught exception, an argparse usage error or a non-zero
`sys.exit` is written as a RankError into AUTOTUNER_ERROR_DIR, so the tuner learns which rank
failed and why without reading logs; scripts need not import autotuner for that (DeepSpeed
scripts do not). The warm runner calls `run` in a process forked from its forkserver; the cold
path runs this module in a fresh interpreter. Both leave with the same exit status.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from autotuner.core.boundary import ERROR_DIR_ENV, write_record
from autotuner.core.launch_records import RankError, error_message
from autotuner.core.parent_death import die_with_parent
from autotuner.core.rank_setup import QUIET_ERRORS_ENV, setup_rank
from autotuner.launch.accelerate_launch import accelerate_rank_args, cpu_world_for_accelerate, trains_through_accelerate


def _record(kind: str, message: str, exit_code: int, ours: bool = False) -> None:
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory:
        return
    rank = int(os.environ.get("RANK", 0))
    path = Path(directory) / f"rank{rank}.json"
    if path.exists():
        return  # the first error is the cause; what follows is unwinding
    try:
        write_record(path, RankError(rank, kind, message[:500], exit_code, time.time(), ours))
    except OSError:
        pass


def _record_usage_errors() -> None:
    """argparse prints its message and exits 2; keep the message (the rank's real error)."""
    original = argparse.ArgumentParser.error
    if getattr(original, "autotuner_recorded", False):
        return

    def error(parser: argparse.ArgumentParser, message: str):
        if "unrecognized arguments" in message and "--local_rank" in message:
            # DeepSpeed's launcher passes it too; torchrun and accelerate launch do not.
            message += (" (the launcher passes --local_rank=N to every rank, as DeepSpeed's does; a script that "
                        "does not declare it needs the launcher's --no_local_rank)")
        _record("argparse", f"{parser.prog}: error: {message}", 2)
        return original(parser, message)

    error.autotuner_recorded = True  # type: ignore[attr-defined]
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]


def _exit_status(code: object) -> int:
    """What the interpreter returns for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end_process_group(succeeded: list[bool]) -> None:
    """At exit, after a script that returned normally or exited 0 (see
    runtime.distributed.end_process_group). Registered before the script runs, so it runs after
    the exit handlers the script and the engine register (atexit runs last-in first-out): a rank
    serving FSDP2 shards to rank 0 (runtime/saving/rank_zero_gather.py) waits there first."""
    # The interpreter is exiting, as torch's own exit hook would mark it: a DataLoader iterator
    # the collection below frees must leave its worker processes to multiprocessing's exit
    # handler, which has run by now (registered later, it runs earlier), not join each for up to
    # 5 s on queues that handler closed. DeepSpeed's loader keeps its iterator: 2 workers added
    # 10 s to the end of every rank's run.
    data_utils = sys.modules.get("torch.utils.data._utils")
    if data_utils is not None:
        data_utils.python_exit_status = True
    distributed = sys.modules.get("torch.distributed")
    if succeeded and distributed is not None and distributed.is_available() and distributed.is_initialized():
        from autotuner.runtime.distributed import end_process_group

        end_process_group()


def _measure_deepspeed_engine() -> None:
    """Should the script train on DeepSpeed's own engine: in a tuner's launch, measure it there;
    in a training run, give it the batch ramp its config may ask for (runtime/deepspeed_ramp.py)."""
    from autotuner.core.boundary import request_from_env

    request = request_from_env()
    if request is not None:
        from autotuner.runtime.measure.deepspeed_measure import install

        install(request)
    else:  # a training run: the batch ramp where the engine's config asks for it
        from autotuner.runtime.deepspeed_ramp import install as install_ramp

        install_ramp()


def run(argv: list[str]) -> int:
    """Run `argv[0]` with arguments `argv[1:]` as __main__; return the process's exit status."""
    script, *args = argv
    if trains_through_accelerate(script):  # accelerate launch's part (launch/accelerate_launch.py)
        args = list(accelerate_rank_args(script, tuple(args), os.environ))
    cpu_world_for_accelerate()  # (the Trainer's accelerate state too: it sets ACCELERATE_USE_DEEPSPEED itself)
    sys.argv = [script, *args]
    # `python -m` put the working directory first; `python train.py` (and torchrun, and DeepSpeed's
    # launcher) put only the script's, so a module in the working directory must not shadow one.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    sys.path[0:0] = [str(Path(script).resolve().parent)]
    if "GROUP_RANK" in os.environ:  # the node's rank as the rendezvous gave it (c10d: as the nodes joined)
        os.environ["CROSS_RANK"] = os.environ["GROUP_RANK"]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a cold rank of torch elastic's; warm ones set it when forked
        die_with_parent()
    setup_rank()
    _record_usage_errors()
    _measure_deepspeed_engine()
    succeeded: list[bool] = []
    atexit.register(_end_process_group, succeeded)
    try:
        runpy.run_path(script, run_name="__main__")
        succeeded.append(True)
        return 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
        if status:
            _record("SystemExit", f"exit status {status}", status)
        else:
            succeeded.append(True)  # `sys.exit(main())` that succeeded ends as a return does
        return status
    except KeyboardInterrupt:
        _record("KeyboardInterrupt", "", 128 + signal.SIGINT)
        raise
    except BaseException as err:  # noqa: BLE001 - recorded, then reported as Python would
        from autotuner.core.errors import AutotunerError

        ours = isinstance(err, AutotunerError)
        status = err.exit_code if ours else 1
        _record(type(err).__name__, error_message(str(err)), status, ours)
        if not (ours and os.environ.get(QUIET_ERRORS_ENV) == "1"):
            sys.excepthook(type(err), err, err.__traceback__)
        return status
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _exit(status: int) -> None:
    """Exit with `status`. A failed rank runs its exit handlers, then skips the interpreter's
    teardown, as a warm rank does: its process group is still up (a peer may be inside a
    collective), and tearing it down prints NCCL's "destroy_process_group() was not called" warning
    under the launcher's one-line error, or can hang."""
    if status:
        atexit._run_exitfuncs()  # noqa: SLF001 - what an exit runs first; os._exit below would not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    _exit(run(sys.argv[1:]))
