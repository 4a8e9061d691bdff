"""Starting one launcher agent per node from a hostfile, as pure data.

DeepSpeed's runner reads `host slots=N` lines, filters them with --include/--exclude (or keeps
the first --num_nodes hosts and --num_gpus slots), then starts its launch module on every host
through pdsh. We start our own launcher on every host instead, with --num_nodes, --node_rank,
--master_addr and --master_port, so torch elastic's static rendezvous joins them. The remote
start is a backend that turns a node into an argument list and an environment:

- ssh (default; DeepSpeed's `--launcher pdsh` means the same to us): `ssh [-p PORT] HOST CMD`,
  where CMD is built by shlex-quoting every word, so no user input is ever spliced into a shell
  string unquoted.
- srun (`--launcher slurm`, inside an allocation): one job step per node,
  `srun --nodes=1 --ntasks=1 --nodelist=HOST ... CMD`, with the exports in srun's own environment
  (srun passes it on: --export=ALL).

Exported to every node, as DeepSpeed does: variables starting with PYTHON, MLFLOW, MV2, UCX or
NCCL, this directory prepended to PYTHONPATH, and the KEY=VALUE lines of `.deepspeed_env`
(DS_ENV_FILE) in the home directory and here. Nothing here starts a process.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from autotuner.core.errors import UsageError
from autotuner.launch.resources import parse_hostfile, select_slots

EXPORT_PREFIXES = ("PYTHON", "MLFLOW", "MV2", "UCX", "NCCL")
BACKENDS = {"pdsh": "ssh", "ssh": "ssh", "slurm": "srun", "srun": "srun"}
# Our agent's own flag: stop (and so end its ranks) when the head's pipe closes, whatever ended it.
STOP_WITH_STDIN_FLAG = "--stop_with_stdin"


@dataclass(frozen=True)
class NodeStart:
    """How the head starts one node's agent: a local command (ssh or srun) and its environment."""

    host: str
    node_rank: int
    nproc: int
    cmd: tuple[str, ...]
    env: dict = field(default_factory=dict, hash=False)  # added to the head's environment for `cmd`


@dataclass(frozen=True)
class NodesPlan:
    backend: str
    master_addr: str
    master_port: int
    nodes: tuple[NodeStart, ...]
    checks: tuple[tuple[str, ...], ...] = ()  # run before anything starts; each must exit 0

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.nodes)


def active_hosts(hostfile: str, include: str | None, exclude: str | None, num_nodes: int | None,
                 nproc_per_node: int | None) -> dict[str, list[int]]:
    """The hosts and slot ids to run on, in hostfile order (DeepSpeed's rules: --num_nodes keeps the
    first hosts, --num_gpus the first slots of each; neither mixes with --include/--exclude)."""
    if (include or exclude) and (num_nodes is not None or nproc_per_node is not None):
        raise UsageError("--include/--exclude choose the devices themselves: drop --num_gpus/--nproc_per_node "
                         "and --num_nodes (DeepSpeed refuses the mix too)")
    pool = parse_hostfile(hostfile)
    slots = select_slots(pool, include, exclude)
    if not slots:
        raise UsageError("--exclude: every slot is excluded; nothing is left to run on")
    if num_nodes is not None:
        if num_nodes > len(slots):
            raise UsageError(f"--num_nodes: got {num_nodes}, but --hostfile {hostfile} lists {len(slots)} host(s)")
        slots = dict(list(slots.items())[:num_nodes])
    if nproc_per_node is not None:
        slots = {host: list(range(nproc_per_node)) for host in slots}
    return slots


def exported_env(environ: dict[str, str], cwd: str, home: str | None = None) -> dict[str, str]:
    """What every node's agent gets from the head, in DeepSpeed's order: matching variables, then
    the .deepspeed_env files (home, then here), which win."""
    exports = {key: value for key, value in environ.items() if key.startswith(EXPORT_PREFIXES)}
    exports["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, environ.get("PYTHONPATH")]))
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    for folder in (home or os.path.expanduser("~"), cwd):
        path = Path(folder) / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"{path}:{number}: expected KEY=VALUE, got {line.strip()!r}")
            exports[key.strip()] = value.strip()
    return exports


def agent_command(python: str, host_rank: int, num_nodes: int, nproc: int, master_addr: str, master_port: int,
                  passthrough: tuple[str, ...], script: str, script_args: tuple[str, ...]) -> tuple[str, ...]:
    """Our launcher on one node, joining the others through the static rendezvous."""
    return (python, "-u", "-m", "autotuner", "--num_nodes", str(num_nodes), "--node_rank", str(host_rank),
            "--nproc_per_node", str(nproc), "--master_addr", master_addr, "--master_port", str(master_port),
            STOP_WITH_STDIN_FLAG, *passthrough, script, *script_args)


def ssh_start(host: str, cwd: str, exports: dict[str, str], agent: tuple[str, ...],
              ssh_port: int | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """`ssh HOST 'cd CWD && env K=V ... AGENT'`: every word quoted on its own."""
    remote = shlex.join(("cd", cwd)) + " && " + shlex.join(("env", *(f"{k}={v}" for k, v in exports.items()),
                                                             *agent))
    port = ("-p", str(ssh_port)) if ssh_port is not None else ()
    # BatchMode: fail rather than prompt for a password, as DeepSpeed's PasswordAuthentication=no check does.
    return ("ssh", "-o", "BatchMode=yes", *port, host, remote), {}


def ssh_check(host: str, ssh_port: int | None = None) -> tuple[str, ...]:
    """DeepSpeed's pre-flight: can the head reach HOST over ssh without a password?"""
    port = ("-p", str(ssh_port)) if ssh_port is not None else ()
    return ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *port, host, "true")


def srun_start(host: str, cwd: str, exports: dict[str, str],
               agent: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """One Slurm job step on HOST running the agent; the exports ride in srun's environment."""
    return ("srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--export=ALL", f"--chdir={cwd}",
            "--kill-on-bad-exit=1", *agent), dict(exports)


def plan_nodes(*, hostfile: str, include: str | None, exclude: str | None, num_nodes: int | None,
               nproc_per_node: int | None, master_addr: str | None, master_port: int, launcher: str,
               ssh_port: int | None, ssh_check_hosts: bool = True, passthrough: tuple[str, ...], script: str, script_args: tuple[str, ...],
               python: str, cwd: str, environ: dict[str, str], home: str | None = None) -> NodesPlan:
    backend = BACKENDS.get(launcher.lower())
    if backend is None:
        raise UsageError(f"--launcher: got {launcher!r} with a multi-host --hostfile; supported: pdsh or ssh "
                         "(started over ssh), slurm or srun (job steps inside a Slurm allocation)")
    if backend == "srun" and "SLURM_JOB_ID" not in environ:
        raise UsageError("--launcher slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run under "
                         "salloc/sbatch, or use --launcher ssh")
    hosts = active_hosts(hostfile, include, exclude, num_nodes, nproc_per_node)
    master = master_addr or next(iter(hosts))
    exports = exported_env(environ, cwd, home)
    filtered = bool(include or exclude)
    nodes = []
    for rank, (host, ids) in enumerate(hosts.items()):
        agent = agent_command(python, rank, len(hosts), len(ids), master, master_port, passthrough, script,
                              script_args)
        # A filtered node sees only its chosen devices; slot ids count the GPUs it sees.
        node_exports = {**exports, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} if filtered else {})}
        if backend == "ssh":
            cmd, env = ssh_start(host, cwd, node_exports, agent, ssh_port)
        else:
            cmd, env = srun_start(host, cwd, node_exports, agent)
        nodes.append(NodeStart(host, rank, len(ids), cmd, env))
    checks = tuple(ssh_check(host, ssh_port) for host in hosts) if backend == "ssh" and ssh_check_hosts else ()
    return NodesPlan(backend, master, master_port, tuple(nodes), checks)
