"""One rank of an experiment on a Ray node: an actor in the rank's placement-group bundle that
starts the rank as a process of its own, with the same (cmd, env) a local launch gives it, and
hands back how it ended, its output, and the files it wrote.

The experiment's directory is the tuner's. On a node that shares the tuner's filesystem (the
directory holds this trial's token file) the rank reads and writes it in place; on one that does
not, the actor makes the directory at the same path, writes the trial's inputs there, and returns
what the rank wrote for the tuner to store, then removes what it made.

The rank process runs in a session of its own and dies with the actor (PR_SET_PDEATHSIG), so
killing the actor, or losing its node, leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from autotuner.launch.stopping import GRACE_S, end_processes, make_temporary_dir, remove_temporary_dir

TOKEN_FILE = ".placement_token"
OUTPUT_TAIL_BYTES = 8 * 2**20  # what a rank's stdout/stderr may bring back each


@dataclass(frozen=True)
class RankRun:
    """What the tuner asks one worker to run."""

    command: tuple[str, ...]
    env: dict = field(hash=False)  # laid over the node's own environment
    cwd: str
    directory: str  # the experiment's directory ("" for the final training run)
    token: str = ""
    inputs: dict = field(default_factory=dict, hash=False)  # file name in `directory` -> bytes
    output_patterns: tuple[str, ...] = ()  # globs in `directory` the rank may write
    live: bool = False  # output to the actor's own stdout/stderr (Ray forwards it), not captured


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: int  # shell convention: 128 + N when killed by signal N
    stdout: bytes = b""
    stderr: bytes = b""
    files: dict = field(default_factory=dict, hash=False)  # relative path -> bytes (node without the directory)
    error: str | None = None  # the rank could not start


def _die_with_actor() -> None:
    from autotuner.core.parent_death import die_with_parent

    die_with_parent()


def _tail(path: Path) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - OUTPUT_TAIL_BYTES))
        return handle.read()


class RankWorker:
    """The actor's class (made remote by the runner, so importing this needs no Ray)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def describe(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(), "python": sys.executable}

    def free_port(self, avoid: list[int]) -> int:
        """A port free on this node now, other than `avoid` (those of experiments running here)."""
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
            if port not in avoid:
                return port
        raise RuntimeError("no free port on this node")

    def run(self, rank: int, spec: RankRun) -> RankOutcome:
        directory = Path(spec.directory) if spec.directory else None
        shared = directory is None or _holds_token(directory, spec.token)
        made: Path | None = None
        scratch: str | None = None
        try:
            if not shared:
                made = _materialize(directory, spec.inputs, spec.output_patterns)
            if not Path(spec.cwd).is_dir():
                return RankOutcome(rank, 1, error=f"the working directory {spec.cwd} does not exist on this node")
            env = {**os.environ, **spec.env}
            if os.environ.get("PYTHONPATH") and spec.env.get("PYTHONPATH"):
                # The job's (our package, shipped by Ray) after the launcher's exports.
                env["PYTHONPATH"] = os.pathsep.join([spec.env["PYTHONPATH"], os.environ["PYTHONPATH"]])
            if spec.live:
                status = self._run_process(spec, env, None, None)
                return RankOutcome(rank, status)
            # Named with this actor's pid: an actor killed outright (a stop, a lost node) removes
            # nothing, and the next launcher started on this node sweeps what it left.
            scratch = make_temporary_dir("rank")
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                status = self._run_process(spec, env, stdout, stderr)
            files = {} if shared else _collect(directory, spec.output_patterns)
            return RankOutcome(rank, status, _tail(out), _tail(err), files)
        except OSError as err:
            return RankOutcome(rank, 1, error=f"{type(err).__name__}: {err}")
        finally:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            if scratch is not None:
                remove_temporary_dir(scratch)

    def _run_process(self, spec: RankRun, env: dict, stdout, stderr) -> int:
        with self._lock:
            if self._stopped:
                return 128 + signal.SIGTERM
            self._process = subprocess.Popen(list(spec.command), cwd=spec.cwd, env=env, stdout=stdout, stderr=stderr,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_die_with_actor)
        code = self._process.wait()
        return 128 - code if code < 0 else code

    def stop(self) -> None:
        """End the rank's whole session: SIGTERM, then SIGKILL after a grace period."""
        with self._lock:
            self._stopped = True
            process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            end_processes([psutil.Process(process.pid)], GRACE_S)  # its session and any child that left it
        except psutil.NoSuchProcess:
            pass
        process.wait()


def _holds_token(directory: Path, token: str) -> bool:
    try:
        return (directory / TOKEN_FILE).read_text() == token
    except OSError:
        return False


def _materialize(directory: Path, inputs: dict, patterns: tuple[str, ...]) -> Path | None:
    """Make the experiment's directory on a node that does not share it; returns the topmost
    directory made (removed afterwards), or None when it existed."""
    made = next((p for p in reversed([directory, *directory.parents]) if not p.exists()), None)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _collect(directory, patterns):  # an earlier run's, never to be sent back as this one's
        (directory / stale).unlink()
    for name, content in inputs.items():
        (directory / name).write_bytes(content)
    return made


def _collect(directory: Path, patterns: tuple[str, ...]) -> dict:
    files = {}
    for pattern in patterns:
        for path in directory.glob(pattern):
            if path.is_file():
                files[str(path.relative_to(directory))] = path.read_bytes()
    return files
