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
  (srun passes it on: --export=ALL). The hosts are the allocation's nodes (launch/slurm.py),
  narrowed by a hostfile, --include/--exclude or --num_nodes; rendezvous at the first one's NodeAddr.

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
from autotuner.core.parent_death import LAUNCHED_BY_PID_ENV
from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import DEFAULT_MASTER_PORT, default_nproc_per_node, tuned_values_env
from autotuner.launch.resources import is_this_host, parse_hostfile, select_slots
from autotuner.launch.slurm import (Allocation, allocation_pool, check_whole_slots, ranks_per_node, require_job,
                                    uses_allocation)

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
    notes: tuple[str, ...] = ()  # what the head prints before starting (a missing hostfile, say)

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.nodes)


def active_hosts(hostfile: str, include: str | None, exclude: str | None, num_nodes: int | None,
                 nproc_per_node: int | None) -> dict[str, list[int]]:
    """The hosts and slot ids to run on, in hostfile order (DeepSpeed's rules: --num_nodes keeps the
    first hosts, --num_gpus the first slots of each; neither mixes with --include/--exclude)."""
    return narrow_pool(parse_hostfile(hostfile), f"--hostfile {hostfile} lists", include, exclude, num_nodes,
                       nproc_per_node)


def narrow_pool(pool: dict[str, int], pool_name: str, include: str | None, exclude: str | None,
                num_nodes: int | None, nproc_per_node: int | None) -> dict[str, list[int]]:
    """`active_hosts` over any pool of `host: slots`; `pool_name` says where it came from in the
    --num_nodes refusal ("--hostfile F lists", "the Slurm allocation (job 7) holds")."""
    if (include or exclude) and (num_nodes is not None or nproc_per_node is not None):
        raise UsageError("--include/--exclude choose the devices themselves: drop --num_gpus/--nproc_per_node "
                         "and --num_nodes (DeepSpeed refuses the mix too)")
    slots = select_slots(pool, include, exclude)
    if not slots:
        raise UsageError("--exclude: every slot is excluded; nothing is left to run on")
    if num_nodes is not None:
        if num_nodes > len(slots):
            raise UsageError(f"--num_nodes: got {num_nodes}, but {pool_name} {len(slots)} host(s)")
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


def srun_start(host: str, cwd: str, exports: dict[str, str], agent: tuple[str, ...],
               srun_args: tuple[str, ...] = ()) -> tuple[tuple[str, ...], dict[str, str]]:
    """One Slurm job step on HOST running the agent; the exports ride in srun's environment.
    --ntasks-per-node=1 overrides an sbatch's SLURM_NTASKS_PER_NODE; the step gets the job's
    CPUs and devices on the node (srun's default without --exact). `srun_args`: --slurm_comment
    and --launcher_args, before the agent."""
    # --export=ALL carries this head's whole environment: the tuner's pid that a tuner's launch
    # dies with is not the agent's parent (slurmstepd is), so the agent takes its own parent.
    return ("srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", f"--nodelist={host}", "--export=ALL",
            f"--chdir={cwd}", "--kill-on-bad-exit=1", *srun_args, *agent), {**exports, LAUNCHED_BY_PID_ENV: ""}


def slurm_hosts(allocation: Allocation, hostfile: str | None, include: str | None, exclude: str | None,
                num_nodes: int | None, nproc_per_node: int | None, slots_per_node: int) -> dict[str, list[int]]:
    """The allocation's nodes to run on: all of them, or those a hostfile, --include/--exclude or
    --num_nodes keep (DeepSpeed's rules); without a hostfile each node has `slots_per_node` slots."""
    pool = allocation_pool(allocation, slots_per_node, hostfile, parse_hostfile(hostfile) if hostfile else None)
    pool_name = f"--hostfile {hostfile} lists" if hostfile else f"the Slurm allocation (job {allocation.job_id}) holds"
    hosts = narrow_pool(pool, pool_name, include, exclude, num_nodes, nproc_per_node)
    check_whole_slots(hosts)
    return hosts


def plan_nodes(*, hostfile: str | None, include: str | None, exclude: str | None, num_nodes: int | None,
               nproc_per_node: int | None, master_addr: str | None, master_port: int, launcher: str,
               ssh_port: int | None, ssh_check_hosts: bool = True, passthrough: tuple[str, ...], script: str,
               script_args: tuple[str, ...], python: str, cwd: str, environ: dict[str, str],
               home: str | None = None, allocation: Allocation | None = None, slots_per_node: int = 1,
               srun_args: tuple[str, ...] = (), notes: tuple[str, ...] = (), report_file: str | None = None) -> NodesPlan:
    """One agent per host. Over ssh the hosts are the hostfile's; over srun, the `allocation`'s
    nodes (read by launch/slurm.py), narrowed by the hostfile when one is given."""
    backend = BACKENDS.get(launcher.lower())
    if backend is None:
        raise UsageError(f"--launcher: got {launcher!r} with a multi-host --hostfile; supported: pdsh or ssh "
                         "(started over ssh), slurm or srun (job steps inside a Slurm allocation)")
    if backend == "srun":
        require_job(environ)
        if allocation is None:
            raise ValueError("an srun plan needs the allocation (launch/slurm.py read_allocation)")
        hosts = slurm_hosts(allocation, hostfile, include, exclude, num_nodes, nproc_per_node, slots_per_node)
        master = master_addr or allocation.address(next(iter(hosts)))
    else:
        if hostfile is None:
            raise ValueError("an ssh plan needs a hostfile")
        hosts = active_hosts(hostfile, include, exclude, num_nodes, nproc_per_node)
        master = master_addr or next(iter(hosts))
    exports = exported_env(environ, cwd, home)
    # Over srun a node keeps its first slots, and Slurm sets the devices: nothing to narrow.
    filtered = bool(include or exclude) and backend == "ssh"
    nodes = []
    for rank, (host, ids) in enumerate(hosts.items()):
        # A tuner's launch: node 0's agent writes the report the tuner judges; each other node its own.
        report = () if report_file is None else ("--report_file", report_file if rank == 0 else f"{report_file}.node{rank}")
        agent = agent_command(python, rank, len(hosts), len(ids), master, master_port, (*report, *passthrough),
                              script, script_args)
        # A filtered node sees only its chosen devices; slot ids count the GPUs it sees.
        node_exports = {**exports, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} if filtered else {})}
        if backend == "ssh":
            cmd, env = ssh_start(host, cwd, node_exports, agent, ssh_port)
        else:
            cmd, env = srun_start(host, cwd, node_exports, agent, srun_args)
        nodes.append(NodeStart(host, rank, len(ids), cmd, env))
    checks = tuple(ssh_check(host, ssh_port) for host in hosts) if backend == "ssh" and ssh_check_hosts else ()
    return NodesPlan(backend, master, master_port, tuple(nodes), checks, notes)


def nodes_plan(options: LaunchOptions, python: str, cwd: str, environ: dict[str, str], num_nodes: int | None,
               agent_flags: tuple[str, ...] = (), allocation: Allocation | None = None) -> NodesPlan | None:
    """The head's plan to start one agent per host (plan_nodes): with a hostfile naming other
    hosts (or several), or with --launcher slurm, whose job steps run on the `allocation`'s nodes
    even when there is one (salloc's shell may be on a login node). None when the ranks start here."""
    slurm = uses_allocation(options.launcher)
    hostfile = options.hostfile if options.hostfile is not None and Path(options.hostfile).is_file() else None
    if options.slurm_comment is not None and not slurm:
        raise UsageError("--slurm_comment: only with --launcher slurm (it is srun's --comment on each node's step)")
    if hostfile is None and not slurm:
        return None
    if not Path(options.script).is_file():
        raise UsageError(f"training script not found: {options.script}")
    if not slurm:
        hosts = active_hosts(hostfile, options.include, options.exclude, num_nodes, options.nproc_per_node)
        if len(hosts) == 1 and is_this_host(next(iter(hosts))):
            return None
    who = "--launcher slurm" if slurm else "--hostfile with other hosts"
    if options.rdzv_endpoint or options.node_rank:
        raise UsageError(f"{who} starts every node itself: drop --node_rank/--rdzv_endpoint")
    passthrough: list[str] = list(agent_flags)
    for flag, value in (("--bind_core_list", options.bind_core_list), ("--enable_each_rank_log",
                                                                       options.each_rank_log_dir),
                        ("--rdzv_conf", options.rdzv_conf or None)):
        if value is not None:
            passthrough += [flag, value]
    passthrough += [flag for flag, on in (("--no_local_rank", options.no_local_rank),
                                          ("--bind_cores_to_rank", options.bind_cores_to_rank)) if on]
    if options.tuned_values is not None:  # each node's agent names it to its ranks; read here first, once
        (path,) = tuned_values_env(options).values()
        passthrough += ["--tuned_values", path]
    notes: tuple[str, ...] = ()
    slots_per_node, srun_args = 1, ()
    if slurm:
        if options.hostfile is not None and hostfile is None:
            notes = (f"--hostfile {options.hostfile}: not found; using every node of the Slurm allocation",)
        if hostfile is None and options.nproc_per_node is None:
            # A node's slots: the GPUs per node Slurm gave the job, else what this launcher sees.
            slots_per_node = ranks_per_node(environ) or default_nproc_per_node()
        srun_args = srun_options(options)
    return plan_nodes(hostfile=hostfile, include=options.include, exclude=options.exclude,
                      num_nodes=num_nodes, nproc_per_node=options.nproc_per_node, master_addr=options.master_addr,
                      master_port=options.master_port or DEFAULT_MASTER_PORT, launcher=options.launcher,
                      ssh_port=options.ssh_port, ssh_check_hosts=options.ssh_check, passthrough=tuple(passthrough),
                      script=options.script, script_args=options.script_args, python=python, cwd=cwd,
                      environ=environ, allocation=allocation, slots_per_node=slots_per_node, srun_args=srun_args,
                      notes=notes, report_file=options.report_file)


def srun_options(options: LaunchOptions) -> tuple[str, ...]:
    """--slurm_comment and --launcher_args as srun's words (DeepSpeed's SlurmRunner passes both)."""
    try:
        extra = tuple(shlex.split(options.launcher_args))
    except ValueError as err:
        raise UsageError(f"--launcher_args: got {options.launcher_args!r}; {err}") from None
    comment = (f"--comment={options.slurm_comment}",) if options.slurm_comment else ()
    return (*comment, *extra)
