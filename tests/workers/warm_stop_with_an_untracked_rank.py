"""The root of the warm Ctrl-C hang: a process forked by the tuner's forkserver whose pid never
reached the runner (a stop came while `start_processes` ran). Closing the runner must end it and
return; multiprocessing's own forkserver stop waits, unbounded, for every holder of its pipe.

Prints one JSON line: {"closed_in_s": ..., "rank_alive": ..., "forkserver_alive": ...}.
"""

import json
import multiprocessing
import sys
import time

import psutil

from autotuner.execution.warm import WarmRunner


def main() -> None:
    runner = WarmRunner(sys.argv[1], report=lambda line: None)
    runner._forkserver.ready(lambda line: None)  # noqa: SLF001 - the forkserver, as the first trial starts it
    from multiprocessing import forkserver

    server = psutil.Process(forkserver._forkserver._forkserver_pid)  # noqa: SLF001
    untracked = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(3600,), daemon=False)
    untracked.start()
    rank = psutil.Process(untracked.pid)
    started = time.monotonic()
    runner.close()
    closed_in_s = time.monotonic() - started
    print(json.dumps({"closed_in_s": closed_in_s, "rank_alive": rank.is_running() and rank.status() != "zombie",
                      "forkserver_alive": server.is_running() and server.status() != "zombie"}), flush=True)


if __name__ == "__main__":
    main()
