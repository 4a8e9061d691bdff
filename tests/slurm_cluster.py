"""A real two-node Slurm cluster on this machine, for the tests: munged, one slurmctld and two
slurmd (node1, node2) that share this host and answer on 127.0.0.1, each on its own port.

`start_cluster(directory)` writes a slurm.conf with absolute paths under `directory`, starts what
is not running, and waits until both nodes are idle; `stop_cluster` ends exactly the daemons it
started, by the pids in their pid files (never by name). Where the packages are missing, we are
not root, or the daemons do not come up, `ClusterUnavailable` says why, and the tests skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

NODES = ("node1", "node2")
TOOLS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol", "scancel", "squeue")
MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_KEY = Path("/etc/munge/munge.key")
START_TIMEOUT_S = 60.0


class ClusterUnavailable(Exception):
    """Slurm cannot run here; the message is the tests' skip reason."""


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    directory: Path
    nodes: tuple[str, ...] = NODES
    started_pids: tuple[int, ...] = field(default=(), compare=False)  # daemons to end at the close

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm commands talk to this cluster."""
        return {**(dict(os.environ) if base is None else base), "SLURM_CONF": str(self.conf)}

    def command(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scancel ...) against this cluster."""
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(directory: Path, host: str, ctld_port: int, node_ports: dict[str, int], cpus: int) -> str:
    """The cluster's slurm.conf: every path absolute under `directory`, nodes on 127.0.0.1."""
    lines = [
        "ClusterName=test", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CryptoType=crypto/munge", "MpiDefault=none",
        # linuxproc follows parentage: a job's processes are found without cgroups.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool%n",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd%n.pid",
        f"SlurmctldLogFile={directory}/slurmctld.log", f"SlurmdLogFile={directory}/slurmd%n.log",
        "ReturnToService=2", "InactiveLimit=0", "MinJobAge=10",
        # scancel: SIGTERM, then SIGKILL after KillWait (default 30 s); short, so a test waits little.
        "KillWait=5", "SchedulerType=sched/builtin", "JobAcctGatherType=jobacct_gather/none",
    ]
    lines += [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
              for name, port in node_ports.items()]
    lines.append(f"PartitionName=debug Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP "
                 "OverSubscribe=YES")
    return "\n".join(lines) + "\n"


def _munge_works() -> bool:
    try:
        encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if encoded.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_munged() -> int | None:
    """Reuse a working munged; else start one as the munge user. Its pid when we started it."""
    if _munge_works():
        return None
    if not MUNGE_KEY.exists():
        raise ClusterUnavailable(f"no munge key at {MUNGE_KEY} (create one: /usr/sbin/create-munge-key)")
    MUNGE_RUN_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_RUN_DIR, "munge", "munge")
    pid_file = MUNGE_RUN_DIR / "munged.pid"
    started = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged --force"], capture_output=True,
                             text=True, timeout=30, env=_daemon_env())
    if started.returncode != 0:
        raise ClusterUnavailable(f"munged did not start: {started.stderr.strip()[-300:]}")
    deadline = time.monotonic() + 10
    while not _munge_works():
        if time.monotonic() > deadline:
            raise ClusterUnavailable("munged started but munge -n | unmunge still fails")
        time.sleep(0.2)
    return int(pid_file.read_text().split()[0]) if pid_file.exists() else None


def _daemon_env() -> dict[str, str]:
    # A test's marker (conftest's orphan check) must not ride on the daemons: they outlive tests by design.
    return {key: value for key, value in os.environ.items() if key != "AUTOTUNER_TEST_MARK"}


def _pid_from(path: Path, deadline: float) -> int:
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise ClusterUnavailable(f"{path.name} never appeared")
        time.sleep(0.1)
    return int(path.read_text().split()[0])


def start_cluster(directory: Path) -> SlurmCluster:
    """Start munged (unless one works), slurmctld and two slurmd; wait for both nodes to be idle."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        raise ClusterUnavailable(f"Slurm is not installed here (missing: {', '.join(missing)})")
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting slurmd needs root")
    directory.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    ports = {name: _free_port() for name in NODES}
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory, host, _free_port(), ports, os.cpu_count() or 1))
    (directory / "state").mkdir(exist_ok=True)
    started: list[int] = []
    cluster = SlurmCluster(conf, directory)
    try:
        munged = _start_munged()
        if munged is not None:
            started.append(munged)
        env = {**_daemon_env(), "SLURM_CONF": str(conf)}
        daemons = [(["slurmctld", "-f", str(conf), "-i"], directory / "slurmctld.pid")]
        daemons += [(["slurmd", "-f", str(conf), "-N", name], directory / f"slurmd{name}.pid") for name in NODES]
        for argv, pid_file in daemons:
            # Each daemon forks into the background and writes its pid file: it is no child of the tests.
            result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise ClusterUnavailable(f"{argv[0]} did not start: {result.stderr.strip()[-300:]}")
            started.append(_pid_from(pid_file, time.monotonic() + 15))
        cluster = SlurmCluster(conf, directory, started_pids=tuple(started))
        _wait_idle(cluster)
    except BaseException:
        stop_cluster(SlurmCluster(conf, directory, started_pids=tuple(started)))
        raise
    return cluster


def _wait_idle(cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    states = ""
    while time.monotonic() < deadline:
        try:
            result = cluster.command("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
            states = result.stdout.strip() or result.stderr.strip()
            if sorted(states.splitlines()) == [f"{name} idle" for name in NODES]:
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
    log = cluster.directory / "slurmctld.log"
    tail = " | ".join(log.read_text().splitlines()[-3:]) if log.exists() else ""
    raise ClusterUnavailable(f"the nodes were not idle after {START_TIMEOUT_S:.0f} s (sinfo: {states!r}; {tail})")


def stop_cluster(cluster: SlurmCluster) -> None:
    """Cancel what still runs, then end the daemons we started: SIGTERM, then SIGKILL."""
    if cluster.started_pids:
        try:
            cluster.command("scancel", "--full", "--user", "root", timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    processes = []
    for pid in cluster.started_pids:
        try:
            processes.append(psutil.Process(pid))
            os.kill(pid, signal.SIGTERM)
        except (psutil.Error, ProcessLookupError):
            continue
    _, alive = psutil.wait_procs(processes, timeout=15)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def job_processes(job_id: str) -> list[psutil.Process]:
    """Live processes of a Slurm job: those whose environment names it (every task, and what the
    tasks started, inherits SLURM_JOB_ID); slurmstepd's own environment does not."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SLURM_JOB_ID") == job_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found
