"""Experiments as job steps inside a Slurm allocation (`--backend slurm`).

Each experiment takes `nodes_per_trial` of the allocation's nodes, and as many run at once as the
free nodes allow. An experiment is our launcher as a head, run here: `python -m autotuner
--report_file F --launcher slurm --hostfile <its nodes> ...`, which starts one agent per node as a
job step (launch/nodes.py, launch/node_runner.py) and stops them all on every path: the cold
launch with its nodes named. With warm launches (below) a one-node trial runs on that node's
server instead. Either way it is prepared and judged as on every runner.

Before nodes are handed out, and when an experiment fails, Slurm is asked which nodes the job still
holds and in what state (`scontrol show job`, `scontrol show node`): a node that went DOWN,
DRAINED or FAILED, or that the job lost (a node failure under `salloc --no-kill`), is given to no
further experiment. An experiment that failed on a lost node is launched again on the nodes
left, once: the node's failure is not the configuration's. When no node is left for what waits,
the wait ends with a failed result. When the job itself has ended (scancel, its time limit), the
tune stops as on SIGTERM: nothing cut short is recorded, and a tune in a new allocation resumes.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import psutil

from autotuner.core.errors import LaunchError, UsageError
from autotuner.execution.node_server import NodeServer, server_command
from autotuner.execution.trial_launch import cold_launch, judge, prepare
from autotuner.launch.nodes import srun_start
from autotuner.launch.options import LaunchOptions
from autotuner.launch.slurm import Allocation, hardware_summary
from autotuner.launch.stopping import GRACE_S, Stopped, end_processes
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.trial import Trial

_STATE = re.compile(r"(?:^|\s)NodeName=(\S+).*?\sState=(\S+)")
_JOB_STATE = re.compile(r"(?:^|\s)JobState=(\S+)")
_JOB_NODES = re.compile(r"(?:^|\s)NodeList=(\S+)")
LIVE_JOB_STATES = ("RUNNING", "CONFIGURING", "SUSPENDED")
UNUSABLE = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN")
COMPLETING_WAIT_S = 10.0
FIRST_PORT = 29600  # the trials' rendezvous ports: FIRST_PORT + the job's slot, one per concurrent trial


def unusable_nodes(show_node_output: str) -> set[str]:
    """The nodes `scontrol show node -o` reports DOWN, draining, failed or not responding."""
    return {name for name, state in _STATE.findall(show_node_output)
            if any(word in state.upper() for word in UNUSABLE)}


def job_end(show_job_output: str, returncode: int) -> str | None:
    """None while `scontrol show job -o` says the job runs; else how it ended (CANCELLED, ...)."""
    if returncode != 0:
        return "no longer known to Slurm"
    state = _JOB_STATE.search(show_job_output)
    return None if state is None or state.group(1) in LIVE_JOB_STATES else state.group(1)


class AllocationEnded(Stopped):
    """The job the tune runs in ended under it (scancel, its time limit, a node failure without
    --no-kill): a stop like SIGTERM, so no experiment it cut short is recorded, and a tune started
    in a new allocation resumes from the records kept."""

    def __init__(self, job_id: str, how: str):
        super().__init__(signal.SIGTERM)
        self.job_id, self.how = job_id, how

    @property
    def name(self) -> str:
        return f"the end of Slurm job {self.job_id} ({self.how})"

    resume_hint = "Resume with the same command in a new allocation."


def trial_hostfile(hosts: tuple[str, ...], nproc_per_node: int) -> str:
    return "".join(f"{host} slots={nproc_per_node}\n" for host in hosts)


def slurm_trial_command(trial: Trial, hostfile: Path, port: int, environ: dict[str, str]) -> tuple[list[str], dict]:
    """The cold launch of `trial` with its nodes: our launcher as the head of `--launcher slurm`."""
    command, env = cold_launch(trial, environ)
    flags = ["--launcher", "slurm", "--hostfile", str(hostfile), "--master_port", str(port)]
    if "--nproc_per_node" in command:  # the hostfile's slots count the ranks
        at = command.index("--nproc_per_node")
        del command[at:at + 2]
    return [*command[:3], *flags, *command[3:]], env


@dataclass
class _Running:
    trial: Trial
    hosts: tuple[str, ...]
    port: int
    process: subprocess.Popen | None  # the cold launch's head; None on a node's warm server
    started: float


class ServerEnded(tuple):
    """A trial's outcome when its node's server ended under it: (srun's status, not timed out)."""

    def __new__(cls, returncode: int):
        return super().__new__(cls, (returncode, False))


@dataclass(frozen=True)
class WarmNodes:
    """What each node's server preloads: the script's imports and `autotuning.warm_preload`."""

    script: str
    preload: tuple[str, ...] = ()


class SlurmRunner:
    """The Runner protocol (tuning/trials/runner.py) over the allocation's nodes."""

    name = "slurm"

    def __init__(self, allocation: Allocation, nodes_per_trial: int, nproc_per_node: int,
                 say: Callable[[str], None], environ: dict[str, str] | None = None,
                 run: Callable = subprocess.run, max_concurrent: int | None = None, warm: WarmNodes | None = None):
        if nodes_per_trial > len(allocation.nodes):
            raise UsageError(f"--num_nodes: got {nodes_per_trial}, but the Slurm allocation (job {allocation.job_id}) "
                             f"holds {len(allocation.nodes)} node(s)")
        self.allocation = allocation
        self.hardware = hardware_summary(allocation)
        # The optimal command runs its ranks as job steps on the allocation's nodes, as the trials did
        # (under salloc the tuner's own host may be a login node).
        self.placement_flags = ("--launcher", "slurm", "--num_nodes", str(nodes_per_trial))
        self.nodes_per_trial = nodes_per_trial
        self.nproc_per_node = nproc_per_node
        self.capacity = min(len(allocation.nodes) // nodes_per_trial, max_concurrent or len(allocation.nodes))
        self._say = say
        self._environ = dict(os.environ) if environ is None else environ
        self._run = run
        self._free = list(allocation.nodes)
        self._lost: set[str] = set()  # nodes Slurm reported unusable
        self._ports = [FIRST_PORT + (int(allocation.job_id) % 50) * 8 + slot for slot in range(self.capacity)]
        self._waiting: deque[Trial] = deque()
        self._relaunched: set[Trial] = set()  # launched again after a node loss: not a second time
        self._running: dict[int, _Running] = {}
        self._done: queue.Queue = queue.Queue()  # (key, the result, or (returncode, timed out) to judge)
        self._keys = itertools.count()
        self._warm = warm if nodes_per_trial == 1 else None
        self._servers: dict[str, NodeServer] = {}
        self._cold_hosts: set[str] = set()  # their server ended unasked: cold from then on
        self._backstops: dict[int, threading.Timer] = {}  # per warm trial: ends a server that stopped answering
        say(f"slurm: job {allocation.job_id}, {len(allocation.nodes)} node(s) ({allocation.nodelist}); "
            f"{nodes_per_trial} per experiment, up to {self.capacity} at once")
        if warm is not None:
            say("slurm: warm launches: a preloaded server on each node, started with its first experiment"
                if self._warm is not None else "slurm: launches are cold: warm launches need one node per experiment")

    # ----- the Runner protocol -----
    def run(self, trial: Trial) -> TrialResult:
        self.submit(trial)
        while True:
            done, result = self.next_result()
            if done is trial:
                return result

    def submit(self, trial: Trial) -> None:
        self._waiting.append(trial)
        self._start_waiting()

    def next_result(self) -> tuple[Trial, TrialResult]:
        while True:
            if not self._running and self._waiting:  # nothing will free a node: refuse what waits
                trial = self._waiting.popleft()
                return trial, TrialResult(trial.experiment, TrialState.FAILED, error=(
                    f"no usable node left in Slurm job {self.allocation.job_id} for {self.nodes_per_trial} node(s) "
                    f"(unusable: {', '.join(sorted(self._lost)) or 'none'})"))
            key, outcome = self._done.get()
            running = self._running.pop(key)
            if (backstop := self._backstops.pop(key, None)) is not None:
                backstop.cancel()
            result = (outcome if isinstance(outcome, TrialResult)
                      else judge(running.trial, outcome[0], outcome[1], time.monotonic() - running.started))
            self._ports.append(running.port)
            if result.state is not TrialState.OK and (ended := self._job_end()) is not None:
                self.close()  # what still runs was cut short too: nothing of it is recorded
                raise AllocationEnded(self.allocation.job_id, ended)
            lost = self._lost_nodes() & set(running.hosts) if result.state is not TrialState.OK else set()
            self._free += [h for h in running.hosts if h not in self._lost]
            name = running.trial.experiment.name
            if running.trial not in self._relaunched:
                if lost:
                    self._launch_again(running.trial, f"slurm: {name} failed on node(s) {', '.join(sorted(lost))}, "
                                       "which the job lost; launched again on the nodes left")
                    continue
                if isinstance(outcome, ServerEnded):
                    # The server failed, not the configuration (an srun without --overlap, say): the
                    # node stays usable, and launches there start cold from now on.
                    self._launch_again(running.trial, f"slurm: {name} was cut short by the end of "
                                       f"{running.hosts[0]}'s warm server; launched again, cold")
                    continue
            if lost:
                result = replace(result, state=TrialState.FAILED,
                                 error=f"node(s) {', '.join(sorted(lost))} lost twice: {result.error or 'ended'}")
            self._start_waiting()
            return running.trial, replace(result, hosts=running.hosts)

    def _launch_again(self, trial: Trial, why: str) -> None:
        """Once per trial: what cut it short was not its configuration."""
        self._relaunched.add(trial)
        self._say(why)
        self._waiting.appendleft(trial)
        self._start_waiting()

    def train(self, options: LaunchOptions, quiet: bool) -> int:
        """The user's job across the allocation, as the experiments ran: our launcher with
        --launcher slurm on `nodes_per_trial` nodes, to its end, output to the terminal."""
        from autotuner.launch.node_runner import run_nodes
        from autotuner.launch.nodes import nodes_plan

        self._close_servers()  # each holds a job step and a forkserver's memory on its node
        options = replace(options, launcher="slurm")
        plan = nodes_plan(options, sys.executable, os.getcwd(), self._environ, num_nodes=self.nodes_per_trial,
                          allocation=self.allocation)
        if plan is None:  # nodes_plan plans every --launcher slurm launch; None would be our bug
            raise LaunchError("--backend slurm: no node plan for the training run")
        return run_nodes(plan, self._environ)

    def close(self) -> None:
        """End every running experiment: its head stops its job steps (closing each agent's stdin)."""
        self._waiting.clear()
        heads = []
        for running in self._running.values():
            try:
                if running.process is not None:
                    heads.append(psutil.Process(running.process.pid))
            except psutil.NoSuchProcess:
                pass
        try:
            end_processes(heads, grace_s=GRACE_S + 5.0)
            for running in self._running.values():
                if running.process is not None:
                    running.process.wait()
        finally:
            self._close_servers()
        self._running.clear()

    def _close_servers(self) -> None:
        """Each node's server ends its running trial's ranks when its stdin closes: all at once."""
        for backstop in self._backstops.values():
            backstop.cancel()
        self._backstops.clear()
        servers = list(self._servers.values())
        self._servers.clear()
        for server in servers:
            server.closing = True
            try:
                server.process.stdin.close()
            except OSError:
                pass
        for server in servers:
            server.close(GRACE_S + 5.0)

    # ----- placement -----
    def _job_end(self) -> str | None:
        """How the job ended, or None while it runs. COMPLETING is waited out for a few seconds: the
        state after it says why (CANCELLED, TIMEOUT, NODE_FAIL)."""
        deadline = time.monotonic() + COMPLETING_WAIT_S
        while True:
            try:
                shown = self._run(["scontrol", "show", "job", "-o", self.allocation.job_id], capture_output=True,
                                  text=True, timeout=30, env=self._environ)
            except (OSError, subprocess.TimeoutExpired):
                return None
            ended = job_end(shown.stdout, shown.returncode)
            if ended != "COMPLETING" or time.monotonic() > deadline:
                return ended
            time.sleep(0.2)


    def _lost_nodes(self) -> set[str]:
        """Nodes of the allocation no longer usable: DOWN, draining or failed, or no longer in the
        job (a node failure under --no-kill); kept in `_lost` from then on."""
        lost = set()
        shown = self._scontrol("show", "node", "-o", self.allocation.nodelist)
        if shown is not None:
            lost |= unusable_nodes(shown)
        job = self._scontrol("show", "job", "-o", self.allocation.job_id)
        nodelist = _JOB_NODES.search(job) if job is not None else None
        if nodelist is not None and nodelist.group(1) not in ("(null)", ""):
            names = self._scontrol("show", "hostnames", nodelist.group(1))
            if names is not None:
                lost |= set(self.allocation.nodes) - {line.strip() for line in names.splitlines() if line.strip()}
        new = lost - self._lost
        if new:
            self._say(f"slurm: node(s) {', '.join(sorted(new))} lost (down, or no longer in job "
                      f"{self.allocation.job_id}); not given to further experiments")
        self._lost |= lost
        return self._lost

    def _scontrol(self, *args: str) -> str | None:
        try:
            shown = self._run(["scontrol", *args], capture_output=True, text=True, timeout=30, env=self._environ)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return shown.stdout if shown.returncode == 0 else None

    def _start_waiting(self) -> None:
        if not self._waiting:
            return
        self._lost_nodes()
        self._free = [h for h in self._free if h not in self._lost]
        while self._waiting and len(self._free) >= self.nodes_per_trial and self._ports:
            trial = self._waiting.popleft()
            hosts, self._free = tuple(self._free[:self.nodes_per_trial]), self._free[self.nodes_per_trial:]
            self._start(trial, hosts, self._ports.pop(0))

    def _start(self, trial: Trial, hosts: tuple[str, ...], port: int) -> None:
        prepare(trial)
        hostfile = trial.directory / "hostfile"
        hostfile.write_text(trial_hostfile(hosts, self.nproc_per_node))
        if self._warm is not None and hosts[0] not in self._cold_hosts:
            key = next(self._keys)
            self._running[key] = _Running(trial, hosts, port, None, time.monotonic())
            server = self._server(hosts[0], trial.directory.parent, self._warm)
            server.run(key, trial)
            # The server keeps the time limit (and may launch the trial a second time, cold); this
            # is for a server that stopped answering.
            backstop = threading.Timer(2 * trial.settings.timeout_s + 60.0, self._backstop, args=(server, key))
            backstop.daemon = True
            backstop.start()
            self._backstops[key] = backstop
            return
        command, env = slurm_trial_command(trial, hostfile, port, self._environ)
        with open(trial.directory / "stdout.log", "wb") as out, open(trial.directory / "stderr.log", "wb") as err:
            process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        key = next(self._keys)
        self._running[key] = _Running(trial, hosts, port, process, time.monotonic())
        threading.Thread(target=self._wait, args=(key, process, trial.settings.timeout_s), daemon=True).start()

    def _wait(self, key: int, process: subprocess.Popen, timeout_s: float) -> None:
        try:
            returncode, timed_out = process.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            try:  # the head stops its steps on SIGTERM (each agent's stdin closes), then the tree is killed
                end_processes([psutil.Process(process.pid)], grace_s=GRACE_S + 5.0)
            except psutil.NoSuchProcess:
                pass  # it ended as the time ran out
            returncode, timed_out = process.wait(), True
        self._done.put((key, (returncode, timed_out)))

    # ----- warm launches -----
    def _server(self, host: str, exps_dir: Path, warm: WarmNodes) -> NodeServer:
        if host not in self._servers:
            command, env = srun_start(host, os.getcwd(), self._environ,
                                      tuple(server_command(sys.executable, warm.script, warm.preload)),
                                      ("--overlap",))
            self._servers[host] = NodeServer(host, command, {**self._environ, **env},
                                             exps_dir / f".node_server-{host}.log",
                                             on_result=lambda key, result: self._done.put((key, result)),
                                             on_end=self._server_ended, say=self._say)
        return self._servers[host]

    @staticmethod
    def _backstop(server: NodeServer, key: int) -> None:
        if server.running_key == key and not server.closing:
            try:  # its step's end reports the trial failed (_server_ended)
                end_processes([psutil.Process(server.process.pid)], grace_s=GRACE_S)
            except psutil.NoSuchProcess:
                pass

    def _server_ended(self, server: NodeServer, key: int | None) -> None:
        """A node's step ended. Unasked (its node lost, the job ended, a crash): the trial it ran
        fails as a cold launch's head would, and that node launches cold from then on."""
        if server.closing:
            return
        if self._servers.get(server.host) is server:
            del self._servers[server.host]
        self._cold_hosts.add(server.host)
        self._say(f"slurm: the warm server on {server.host} ended (srun status {server.process.returncode}); "
                  "launches on it start cold from now on")
        if key is not None:
            self._done.put((key, ServerEnded(server.process.returncode or 1)))
