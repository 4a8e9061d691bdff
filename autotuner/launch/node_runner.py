"""The head node: start every node's agent from a NodesPlan, wait, and end them all on every path.

Each node's start command (ssh or srun) runs in its own session with a pipe on its stdin that the
head never writes. The agents run with --stop_with_stdin, so when the pipe closes -- the head
ending them, or the head dying by any signal -- each agent stops and torch elastic ends its ranks.
What is still running after a grace period is ended by process group.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

from autotuner.errors import UsageError
from autotuner.launch.nodes import NodesPlan
from autotuner.launch.runner import exit_status

GRACE_S = 15.0  # for agents to end their ranks after their stdin closes


class _Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise _Stopped(signum)


def preflight(plan: NodesPlan, environ: dict[str, str]) -> None:
    """Every node reachable before anything starts (DeepSpeed checks its first host over ssh)."""
    tool = plan.nodes[0].cmd[0]
    if shutil.which(tool, path=environ.get("PATH")) is None:
        raise UsageError(f"--hostfile: {tool} is not on PATH; it is needed to start the nodes "
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
    hosts = ", ".join(f"{n.host} (node {n.node_rank}, {n.nproc} rank(s))" for n in plan.nodes)
    print(f"launcher: starting {len(plan.nodes)} nodes over {plan.backend}: {hosts}; rendezvous at "
          f"{plan.master_addr}:{plan.master_port}", file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
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
    except (KeyboardInterrupt, _Stopped) as stop:
        signum = stop.signum if isinstance(stop, _Stopped) else signal.SIGINT
        print(f"launcher: stopped by {signal.Signals(signum).name}; stopping every node", file=sys.stderr)
        code = 128 + signum
    finally:
        _end_all(started)
        signal.signal(signal.SIGTERM, previous)
    return code


def _end_all(started: list[tuple]) -> None:
    """Close every agent's stdin (it stops and ends its ranks), then end what is left by group."""
    for _, process in started:
        try:
            process.stdin.close()
        except OSError:
            pass
    for sig, wait_s in ((None, GRACE_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        running = [p for _, p in started if p.poll() is None]
        if not running:
            return
        for process in running:
            if sig is not None:
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
