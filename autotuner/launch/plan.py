"""Pure launch planning: from options to a frozen LaunchPlan. Nothing here starts a process."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotuner.errors import UsageError

DEFAULT_MASTER_PORT = 29500
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked for on the command line. None means "choose for me"."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None


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

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.num_nodes


def visible_gpus() -> int:
    """CUDA devices this process may use (0 on a CPU-only machine); makes no CUDA context."""
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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc_per_node))}


def build_plan(options: LaunchOptions, python: str, environ: dict[str, str] | None = None) -> LaunchPlan:
    """Check the options and turn them into a plan (static rendezvous for multi-node, c10d otherwise)."""
    environ = dict(os.environ) if environ is None else environ
    if not Path(options.script).is_file():
        raise UsageError(f"training script not found: {options.script}")
    nproc = options.nproc_per_node if options.nproc_per_node is not None else default_nproc_per_node()
    if nproc < 1:
        raise UsageError(f"--nproc_per_node: got {nproc}; expected a positive number of ranks per node")
    gpus = visible_gpus()
    if gpus and nproc > gpus:
        # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected").
        raise UsageError(f"--nproc_per_node: got {nproc}, but only {gpus} GPU(s) are visible; nccl needs one GPU "
                         f"per rank, so use at most {gpus}")
    if options.num_nodes < 1:
        raise UsageError(f"--num_nodes: got {options.num_nodes}; expected a positive number of nodes")
    if not 0 <= options.node_rank < options.num_nodes:
        raise UsageError(f"--node_rank: got {options.node_rank}; expected 0..{options.num_nodes - 1}")
    if options.master_port is not None and not 0 < options.master_port < 65536:
        raise UsageError(f"--master_port: got {options.master_port}; expected 1..65535")
    command = (python, "-u", options.script, *options.script_args)
    env = thread_env(nproc, environ)
    run_id = options.rdzv_id or uuid.uuid4().hex[:12]
    local_addr = options.master_addr or LOOPBACK

    if options.rdzv_endpoint:
        # Elastic (c10d) rendezvous across nodes: every node passes the same endpoint and id.
        return LaunchPlan(command, nproc, options.num_nodes, "c10d", options.rdzv_endpoint, {}, run_id,
                          local_addr=_local_address(options), env=env)
    if options.num_nodes > 1:
        if not options.master_addr:
            raise UsageError("--num_nodes > 1 needs --master_addr (the address of node 0), or --rdzv_endpoint")
        port = options.master_port or DEFAULT_MASTER_PORT
        return LaunchPlan(command, nproc, options.num_nodes, "static", f"{options.master_addr}:{port}",
                          {"rank": options.node_rank}, run_id, local_addr=_local_address(options), env=env)
    # One node: rendezvous on loopback; port 0 lets the OS pick a free one.
    port = options.master_port or 0
    return LaunchPlan(command, nproc, 1, "c10d", f"{local_addr}:{port}", {}, run_id, local_addr=local_addr, env=env)


def config_checked(plan: LaunchPlan) -> LaunchPlan:
    """The launcher has printed the config's warnings: the ranks need not repeat them."""
    from autotuner.rank_setup import CONFIG_CHECKED_ENV

    return replace(plan, env={**plan.env, CONFIG_CHECKED_ENV: "1"})


def _local_address(options: LaunchOptions) -> str | None:
    # On node 0 the master address is ours; elsewhere let torch find this host's name.
    return options.master_addr if options.node_rank == 0 and options.master_addr else None
