"""Pure launch planning: from options to a frozen LaunchPlan. Nothing here starts a process."""

from __future__ import annotations

import ctypes.util
import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotuner.core.errors import UsageError
from autotuner.launch.core_binding import core_binding
from autotuner.launch.numa import numa_node_cpus
from autotuner.launch.options import LaunchOptions
from autotuner.launch.resources import is_this_host, parse_hostfile, select_slots

DEFAULT_MASTER_PORT = 29500
TORCHRUN_DEFAULT_RDZV_ID = "none"
LOOPBACK = "127.0.0.1"


LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything torch elastic needs to start one job's ranks."""

    command: tuple[str, ...]  # the program each rank runs, e.g. (python, -u, train.py, args...)
    nproc_per_node: int
    num_nodes: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_configs: dict = field(default_factory=dict, hash=False)
    run_id: str = ""
    local_addr: str = LOOPBACK
    env: dict = field(default_factory=dict, hash=False)  # set in the launcher before ranks start
    notes: tuple[str, ...] = ()  # what the launcher prints before starting (a missing hostfile, say)
    each_rank_log_dir: str | None = None  # made by the runner before the ranks start
    report_file: str | None = None  # where the runner writes its LaunchReport (a tuner's launch)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.num_nodes


# A CUDA (or ROCm) device needs its driver's device files: without them torch sees no GPU, and
# the launcher need not import torch (about 2 CPU-seconds) to learn so.
GPU_DRIVER_PATHS = ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def visible_gpus() -> int:
    """CUDA devices this process may use (0 on a CPU-only machine); makes no CUDA context."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return 0


def default_nproc_per_node() -> int:
    """All visible GPUs, or one process on CPU."""
    return visible_gpus() or 1


def thread_env(nproc_per_node: int, environ: dict[str, str]) -> dict[str, str]:
    """Split the cores between local ranks unless the user pinned OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cpus() // nproc_per_node))}


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a cgroup's cpuset), which its ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _pool(options: LaunchOptions, environ: dict[str, str], gpus: int) -> tuple[dict[str, int] | None, list[str]]:
    """This node's slots when a hostfile or --include/--exclude asks for them, else None."""
    notes: list[str] = []
    if options.hostfile is not None:
        if not Path(options.hostfile).is_file():
            notes.append(f"--hostfile {options.hostfile}: not found; training with this node's resources only "
                         "(as DeepSpeed does)")
        else:
            pool = parse_hostfile(options.hostfile)
            others = [host for host in pool if not is_this_host(host)]
            if others:
                # A plain launch starts every host from it (nodes.py nodes_plan); the tuner and --bench run on one.
                raise UsageError(f"--hostfile {options.hostfile}: lists other hosts ({', '.join(others)}); "
                                 "--autotuning and --bench run on one node for now: tune with a hostfile naming only "
                                 "this host, then train on every host with the optimal config")
            return pool, notes
    if options.include or options.exclude:
        return {"localhost": gpus if gpus else _cpu_slots(environ)}, notes
    return None, notes


def _cpu_slots(environ: dict[str, str]) -> int:
    # DeepSpeed's CPU accelerator: LOCAL_SIZE, else one slot per NUMA node with cores.
    if int(environ.get("LOCAL_SIZE", 0) or 0) > 0:
        return int(environ["LOCAL_SIZE"])
    nodes = {p.read_text().strip() for p in Path("/sys/devices/system/node").glob("node*/cpulist")}
    return max(1, len({cpus for cpus in nodes if cpus}))


def _selected_devices(options: LaunchOptions, environ: dict[str, str], gpus: int) -> tuple[int | None, dict, list]:
    """(ranks per node, env, notes) from --hostfile/--include/--exclude; (None, {}, notes) without them."""
    if (options.include or options.exclude) and (options.nproc_per_node is not None or options.num_nodes != 1):
        raise UsageError("--include/--exclude choose the devices themselves: drop --num_gpus/--nproc_per_node "
                         "and --num_nodes (DeepSpeed refuses the mix too)")
    pool, notes = _pool(options, environ, gpus)
    if pool is None:
        return None, {}, notes
    slots = select_slots(pool, options.include, options.exclude, check_include_range=bool(gpus))
    if not slots:
        raise UsageError("--exclude: every slot is excluded; nothing is left to run on")
    (host, ids), = slots.items()
    if options.nproc_per_node is not None:
        return options.nproc_per_node, {}, notes
    env: dict[str, str] = {}
    if gpus and (options.include or options.exclude):
        # Slot ids count the GPUs this launcher sees: through CUDA_VISIBLE_DEVICES when it is set.
        visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if visible else str(i) for i in ids)
    return len(ids), env, notes


def _rank_command(options: LaunchOptions, python: str, nproc: int,
                  environ: dict[str, str]) -> tuple[tuple, dict, tuple[str, ...]]:
    """The program each rank runs, env for it and notes for the user: the deepspeed launcher's
    `--local_rank=N` after the script (torch elastic fills ${local_rank} per rank), behind the
    core-binding/log entry if asked."""
    local_rank = () if options.no_local_rank else ("--local_rank=${local_rank}",)
    # Every rank runs the script through run_script, which ends the default process group after the
    # script returns: left to interpreter teardown, gloo's threads abort a rank that finished
    # ("terminate called without an active exception", status 134; pytorch/pytorch#190489), which
    # DeepSpeed's engine, unlike ours, does not guard against. In a tuner's launch it also records failures.
    command: tuple[str, ...] = (python, "-u", "-m", "autotuner.launch.run_script", options.script, *local_rank,
                                *options.script_args)
    env: dict[str, str] = {}
    entry: list[str] = []
    notes: tuple[str, ...] = ()
    if options.bind_cores_to_rank or options.bind_core_list:
        if not options.bind_cores_to_rank:
            raise UsageError("--bind_core_list: needs --bind_cores_to_rank")
        if "KMP_AFFINITY" in environ:
            # Intel's OpenMP places its threads by KMP_AFFINITY, over the mask each rank is given.
            raise UsageError(f"--bind_cores_to_rank: KMP_AFFINITY is set ({environ['KMP_AFFINITY']!r}) and would place "
                             "each rank's OpenMP threads over the cores it binds; unset it (DeepSpeed's launcher "
                             "refuses it too)")
        binding = core_binding(options.bind_core_list, nproc, sorted(os.sched_getaffinity(0)), numa_node_cpus(),
                               libnuma=ctypes.util.find_library("numa") is not None)
        entry += binding.entry_flags
        env["OMP_NUM_THREADS"] = str(binding.threads_per_rank)
        notes = binding.notes
    if options.each_rank_log_dir is not None:
        if Path(options.each_rank_log_dir).is_file():
            raise UsageError(f"--enable_each_rank_log: {options.each_rank_log_dir} is a file; give a directory")
        entry += ["--log_dir", str(Path(options.each_rank_log_dir).resolve())]
    if entry:
        command = (python, "-m", "autotuner.launch.rank_entry", *entry, "--", *command)
    return command, env, notes


def build_plan(options: LaunchOptions, python: str, environ: dict[str, str] | None = None) -> LaunchPlan:
    """Check the options and turn them into a plan (static rendezvous for multi-node, c10d otherwise)."""
    environ = dict(os.environ) if environ is None else environ
    if not Path(options.script).is_file():
        raise UsageError(f"training script not found: {options.script}")
    if options.launcher.lower() not in LAUNCHERS:
        raise UsageError(f"--launcher: got {options.launcher!r}; expected one of {', '.join(LAUNCHERS)} (on one node "
                         "the ranks start locally whichever is named, as with DeepSpeed)")
    if options.force_multi:
        raise UsageError("--force_multi: starting ranks through pdsh/MPI is not supported; on one node drop it, on "
                         "several start one launcher per node with --num_nodes, --node_rank and --master_addr")
    gpus = visible_gpus()
    selected, device_env, notes = _selected_devices(options, environ, gpus)
    nproc = selected if selected is not None else (
        options.nproc_per_node if options.nproc_per_node is not None else default_nproc_per_node())
    if nproc < 1:
        raise UsageError(f"--nproc_per_node: got {nproc}; expected a positive number of ranks per node")
    if gpus and nproc > gpus and not device_env:
        # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected").
        raise UsageError(f"--nproc_per_node: got {nproc}, but only {gpus} GPU(s) are visible; nccl needs one GPU "
                         f"per rank, so use at most {gpus}")
    if options.num_nodes < 1:
        raise UsageError(f"--num_nodes: got {options.num_nodes}; expected a positive number of nodes")
    if not 0 <= options.node_rank < options.num_nodes:
        raise UsageError(f"--node_rank: got {options.node_rank}; expected 0..{options.num_nodes - 1}")
    if options.master_port is not None and not 0 < options.master_port < 65536:
        raise UsageError(f"--master_port: got {options.master_port}; expected 1..65535")
    command, rank_env, rank_notes = _rank_command(options, python, nproc, environ)
    notes = [*notes, *rank_notes]
    env = {**thread_env(nproc, environ), **device_env, **rank_env, **tuned_values_env(options),
           # What DeepSpeed's launch.py sets besides torch elastic's variables (CROSS_RANK is the
           # node's rank as the rendezvous gave it: run_script sets it from GROUP_RANK).
           "LOCAL_SIZE": str(nproc), "CROSS_RANK": str(options.node_rank), "CROSS_SIZE": str(options.num_nodes)}
    # Every node's agent must name the same run: static and c10d rendezvous keep their keys under it.
    # torchrun's default id is "none"; one node gets a fresh one so concurrent local jobs never meet.
    shared = options.num_nodes > 1 or options.rdzv_endpoint is not None
    run_id = options.rdzv_id or (TORCHRUN_DEFAULT_RDZV_ID if shared else uuid.uuid4().hex[:12])
    local_addr = options.master_addr or LOOPBACK
    extra = dict(notes=tuple(notes), each_rank_log_dir=options.each_rank_log_dir, report_file=options.report_file)

    rdzv_configs = parse_rdzv_conf(options.rdzv_conf)
    if options.rdzv_backend is not None and not options.rdzv_endpoint:
        raise UsageError(f"--rdzv_backend {options.rdzv_backend}: only with --rdzv_endpoint HOST:PORT (without it, "
                         "--master_addr/--master_port give a static rendezvous)")
    if options.rdzv_endpoint and options.rdzv_backend == "static":
        # torchrun's default backend: the endpoint is node 0's store, and --node_rank numbers the nodes.
        return LaunchPlan(command, nproc, options.num_nodes, "static", options.rdzv_endpoint,
                          {**rdzv_configs, "rank": options.node_rank}, run_id, local_addr=_local_address(options),
                          env=env, **extra)
    if options.rdzv_endpoint:
        # Elastic (c10d) rendezvous across nodes: every node passes the same endpoint and id, and
        # the nodes are numbered as they join, so a --node_rank would be silently ignored.
        if options.node_rank:
            raise UsageError(f"--node_rank {options.node_rank}: the c10d rendezvous at --rdzv_endpoint numbers the nodes "
                             "as they join, so it would be ignored; drop it, or add --rdzv_backend static to number "
                             "the nodes by it (torchrun's default backend)")
        return LaunchPlan(command, nproc, options.num_nodes, "c10d", options.rdzv_endpoint, rdzv_configs, run_id,
                          local_addr=_local_address(options), env=env, **extra)
    if options.num_nodes > 1:
        if not options.master_addr:
            raise UsageError("--num_nodes > 1 needs --master_addr (the address of node 0), or --rdzv_endpoint")
        port = options.master_port or DEFAULT_MASTER_PORT
        return LaunchPlan(command, nproc, options.num_nodes, "static", f"{options.master_addr}:{port}",
                          {**rdzv_configs, "rank": options.node_rank}, run_id, local_addr=_local_address(options), env=env, **extra)
    if options.master_port is not None:
        # As DeepSpeed's launcher (and torchrun's static rendezvous): --master_port is the store the
        # ranks see as MASTER_PORT; scripts and libraries read it.
        return LaunchPlan(command, nproc, 1, "static", f"{local_addr}:{options.master_port}",
                          {**rdzv_configs, "rank": 0}, run_id, local_addr=local_addr, env=env, **extra)
    # One node: rendezvous on loopback; port 0 lets the OS pick a free one.
    port = 0
    return LaunchPlan(command, nproc, 1, "c10d", f"{local_addr}:{port}", rdzv_configs, run_id, local_addr=local_addr,
                      env=env,
                      **extra)


def tuned_values_env(options: LaunchOptions) -> dict[str, str]:
    """The ranks' variable naming the --tuned_values file (as a tuner's launch names its request
    file). The file is read here first, so a missing or damaged one is one line (exit 2) before any
    rank starts rather than one per rank."""
    if options.tuned_values is None:
        return {}
    # Here, not at the top: the config package (pydantic) stays out of the launcher's first imports.
    from autotuner.config.tuned_values import TUNED_VALUES_ENV, read_tuned_values

    read_tuned_values(options.tuned_values)
    return {TUNED_VALUES_ENV: str(Path(options.tuned_values).resolve())}


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's --rdzv_conf: `KEY=VALUE` pairs joined by commas; values stay strings, as torch's
    rendezvous handlers convert them themselves."""
    conf: dict[str, str] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv_conf: got {pair!r}; expected KEY=VALUE pairs joined by commas, e.g. timeout=60")
        if key.strip() == "rank":
            raise UsageError("--rdzv_conf: rank is set by --node_rank")
        conf[key.strip()] = value.strip()
    return conf


def config_checked(plan: LaunchPlan) -> LaunchPlan:
    """The launcher has printed the config's warnings: the ranks need not repeat them."""
    from autotuner.core.rank_setup import CONFIG_CHECKED_ENV

    return replace(plan, env={**plan.env, CONFIG_CHECKED_ENV: "1"})


def _local_address(options: LaunchOptions) -> str | None:
    # On node 0 the master address is ours; elsewhere let torch find this host's name.
    return options.master_addr if options.node_rank == 0 and options.master_addr else None


def elastic_rank_variables(rank: int, local_rank: int, node_rank: int, nproc_per_node: int, num_nodes: int,
                           master_addr: str, master_port: int, run_id: str, agent_store: bool) -> dict[str, str]:
    """torch elastic's per-rank variables, for a rank started by us rather than by its agent; the
    one place they are written. `agent_store`: the store at master_addr is an agent's (rank 0
    hosts it otherwise)."""
    world_size = nproc_per_node * num_nodes
    return {"LOCAL_RANK": str(local_rank), "RANK": str(rank), "GROUP_RANK": str(node_rank), "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc_per_node), "WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": str(num_nodes), "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": str(agent_store)}


def rank_launch(plan: LaunchPlan, local_rank: int, master_addr: str, master_port: int,
                environ: dict[str, str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(cmd, env) of one local rank of a one-node plan, as torch elastic's local agent would start it
    with its own store at master_addr:master_port: ${local_rank} filled in, the launcher's
    environment, then elastic's per-rank variables. The warm runner starts ranks from these."""
    if plan.num_nodes != 1:
        raise ValueError("rank_launch builds one node's ranks")
    command = tuple(arg.replace("${local_rank}", str(local_rank)) for arg in plan.command)
    env = {**environ, **plan.env,
           **elastic_rank_variables(local_rank, local_rank, 0, plan.nproc_per_node, 1, master_addr, master_port,
                                    plan.run_id, agent_store=True),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    return command, env
