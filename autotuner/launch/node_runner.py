"""The head node: start every node's agent from a NodesPlan, wait, and end them all on every path.

Each node's start command (ssh or srun) runs in its own session with a pipe on its stdin that the
head never writes. The agents run with --stop_with_stdin, so when the pipe closes -- the head
ending them, or the head dying by any signal -- each agent stops and torch elastic ends its ranks.
The local start commands (ssh, srun) and what runs under them get SIGTERM, then SIGKILL after a
grace period.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import psutil

from autotuner.core.errors import UsageError
from autotuner.launch.nodes import NodesPlan
from autotuner.launch.elastic import exit_status
from autotuner.launch.stopping import GRACE_S, Stopped, end_processes


def preflight(plan: NodesPlan, environ: dict[str, str]) -> None:
    """Every node reachable before anything starts (DeepSpeed checks its first host over ssh)."""
    tool = plan.nodes[0].cmd[0]
    if shutil.which(tool, path=environ.get("PATH")) is None:
        flag = "--launcher slurm" if plan.backend == "srun" else "--hostfile"
        raise UsageError(f"{flag}: {tool} is not on PATH; it is needed to start the nodes "
                         f"({', '.join(n.host for n in plan.nodes)}) with --launcher {plan.backend}")
    checks = [(cmd, subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)) for cmd in plan.checks]
    failed = []
    for cmd, check in checks:
        _, err = check.communicate()
        if check.returncode != 0:
            last = (err.strip().splitlines() or [f"status {check.returncode}"])[-1]
            failed.append(f"{cmd[-2]} ({last})")
    if failed:
        raise UsageError(f"--hostfile: not reachable over ssh without a password: {'; '.join(failed)}; set up "
                         "passwordless ssh to every host, or pass --no_ssh_check to skip this check")


def run_nodes(plan: NodesPlan, environ: dict[str, str] | None = None) -> int:
    """Start the nodes, return the first failed node's status (0 when all succeed)."""
    environ = dict(os.environ) if environ is None else environ
    preflight(plan, environ)
    for note in plan.notes:
        print(f"launcher: note: {note}", file=sys.stderr, flush=True)
    hosts = ", ".join(f"{n.host} (node {n.node_rank}, {n.nproc} rank(s))" for n in plan.nodes)
    print(f"launcher: starting {len(plan.nodes)} nodes over {plan.backend}: {hosts}; rendezvous at "
          f"{plan.master_addr}:{plan.master_port}", file=sys.stderr, flush=True)
    started: list[tuple] = []
    finished: queue.Queue = queue.Queue()
    code = 0
    try:
        for node in plan.nodes:
            try:
                process = subprocess.Popen(node.cmd, env={**environ, **node.env}, stdin=subprocess.PIPE,
                                           start_new_session=True)
            except FileNotFoundError:
                print(f"launcher: error: {node.cmd[0]} not found: cannot start node {node.node_rank} "
                      f"({node.host}) over {plan.backend}", file=sys.stderr)
                return 2
            started.append((node, process))
            threading.Thread(target=lambda n=node, p=process: finished.put((n, p.wait())), daemon=True).start()
        for _ in plan.nodes:
            node, status = finished.get()
            if status != 0:
                code = exit_status(status)
                why = " (ssh's own failure: connection or authentication)" if plan.backend == "ssh" and code == 255 else ""
                print(f"launcher: node {node.node_rank} ({node.host}) exited with status {code}{why}; stopping the "
                      "other nodes", file=sys.stderr)
                break
    except Stopped as stop:
        print(f"launcher: stopped by {stop.name}; stopping every node", file=sys.stderr, flush=True)
        stop.reported = True
        raise
    finally:
        _end_all(started)
    return code


def _end_all(started: list[tuple]) -> None:
    """Close every agent's stdin: it stops and ends its ranks (over ssh, the only way to reach a
    remote agent). Start commands still running after the grace period are ended with their trees."""
    for _, process in started:
        try:
            process.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + GRACE_S
    for _, process in started:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    left = []
    for _, process in started:
        try:
            if process.poll() is None:
                left.append(psutil.Process(process.pid))
        except psutil.NoSuchProcess:
            pass
    end_processes(left, grace_s=1.0)
    for _, process in started:
        process.wait()
