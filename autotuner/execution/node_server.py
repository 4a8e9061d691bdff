"""Warm launches on a Slurm node: one long job step per node runs this server, which holds a
`WarmRunner` (a forkserver preloaded with torch and the script's imports) and runs the trials the
tuner sends it, one at a time, forking their ranks on the node.

The tuner talks to it over the step's stdin and stdout, which srun forwards: one message a line,
a pickled tuple in base64 (both ends are this package, the same version). The tuner sends
("run", key, trial); the server answers ("say", text) for its notes and ("result", key, result)
for each trial. stdin's end (the tuner closed it, died, or srun ended) stops the server: a trial
running is cut short and its ranks ended (`WarmRunner`), as a stop signal would.

Everything the runner judges a trial from is in the trial's directory, on the filesystem the
tuner and the nodes share, as for cold launches under Slurm.
"""

from __future__ import annotations

import argparse
import base64
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable

import psutil

MODULE = "autotuner.execution.node_server"


def encode(message: tuple) -> bytes:
    return base64.b64encode(pickle.dumps(message)) + b"\n"


def decode(line: bytes) -> tuple[Any, ...] | None:
    """A message, or None for a line that is not one (srun's own notes on a shared stream)."""
    try:
        message = pickle.loads(base64.b64decode(line.strip(), validate=True))
    except Exception:  # noqa: BLE001 - anything that does not decode is not ours
        return None
    return message if isinstance(message, tuple) and message else None


def server_command(python: str, script: str, preload: tuple[str, ...]) -> list[str]:
    return [python, "-u", "-m", MODULE, "--script", script, *(f"--preload={name}" for name in preload)]


class NodeServer:
    """The tuner's end of one node's server: its srun step, and a thread reading its replies.

    `on_result(key, result)` for each trial's result; `on_end(server, key)` once the step has
    ended, with the key of a trial it left unanswered (None if none)."""

    def __init__(self, host: str, command: tuple[str, ...], env: dict[str, str], log_path: Path,
                 on_result: Callable[[int, Any], None], on_end: Callable[["NodeServer", int | None], None],
                 say: Callable[[str], None]):
        self.host = host
        self.running_key: int | None = None
        self.closing = False
        self._on_result, self._on_end, self._say = on_result, on_end, say
        with open(log_path, "ab") as log:  # srun's notes and the server's stderr
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def run(self, key: int, trial: Any) -> None:
        self.running_key = key
        try:
            self.process.stdin.write(encode(("run", key, trial)))
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the step has ended: the reader reports the trial with it

    def _read(self) -> None:
        for line in self.process.stdout:
            message = decode(line)
            if message is None:
                continue
            if message[0] == "say" and not self.closing:
                self._say(f"slurm: {self.host}: {message[1]}")
            elif message[0] == "result":
                self.running_key = None
                self._on_result(message[1], message[2])
        self.process.wait()
        self._on_end(self, self.running_key)

    def close(self, grace_s: float) -> None:
        """stdin's end stops the server (it ends a running trial's ranks); after `grace_s`, srun's
        whole tree is ended."""
        from autotuner.launch.stopping import end_processes

        self.closing = True
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                end_processes([psutil.Process(self.process.pid)], grace_s=grace_s)
            except psutil.NoSuchProcess:
                pass
            self.process.wait()


def _read_requests(stdin: IO[bytes], requests: queue.Queue, busy: threading.Event) -> None:
    """Requests into the queue; at stdin's end a None, and a stop for a trial still running."""
    for line in stdin:
        message = decode(line)
        if message is not None and message[0] == "run":
            requests.put(message)
    requests.put(None)
    if busy.is_set():
        os.kill(os.getpid(), signal.SIGTERM)  # the stop guard cuts the trial short


def serve(script: str, preload: tuple[str, ...]) -> int:
    from autotuner.execution.warm import WarmRunner
    from autotuner.launch.stopping import Stopped, mark_work_started, stop_guard

    # Only messages on the real stdout: anything else printed here goes to stderr.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            replies.write(encode(message))

    requests: queue.Queue = queue.Queue()
    busy = threading.Event()
    with stop_guard():
        mark_work_started()
        runner = WarmRunner(script, preload, report=lambda text: send(("say", text)))
        try:
            threading.Thread(target=_read_requests, args=(sys.stdin.buffer, requests, busy),
                             daemon=True).start()
            while (request := requests.get()) is not None:
                _, key, trial = request
                busy.set()
                result = runner.run(trial)
                busy.clear()
                send(("result", key, result))
        except Stopped:
            return 0  # the tuner has gone, or ended this step: nothing to report to
        finally:
            runner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--script", required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    return serve(args.script, tuple(args.preload))


if __name__ == "__main__":
    sys.exit(main())
