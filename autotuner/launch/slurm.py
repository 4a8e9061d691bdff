"""The Slurm allocation a `--launcher slurm` launch runs in: its nodes and their addresses.

Inside `salloc` or `sbatch`, SLURM_JOB_ID and SLURM_JOB_NODELIST name the job and its nodes in
Slurm's compressed form (node[1-4,7]). `scontrol show hostnames` expands that list and
`scontrol show node -o` gives each node's NodeAddr: the address its slurmd answers on, which is
what the other nodes can reach (a node's name need not resolve; on most clusters the two are the
same). `read_allocation` is the one impure call; the parsers and the narrowing are pure.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

from autotuner.core.errors import LaunchError, UsageError

SLURM_LAUNCHERS = ("slurm", "srun")
_NODE_ADDR = re.compile(r"(?:^|\s)NodeName=(\S+).*?\sNodeAddr=(\S+)")
_GPU_COUNT = re.compile(r"(?:^|:)(\d+)$")


@dataclass(frozen=True)
class Allocation:
    """The job's nodes, in Slurm's order, and the address of each."""

    job_id: str
    nodelist: str  # as Slurm wrote it, for messages: node[1-2]
    nodes: tuple[str, ...]
    addresses: dict = field(default_factory=dict, hash=False)  # NodeName -> NodeAddr
    hardware: dict = field(default_factory=dict, hash=False)  # NodeName -> parse_node_hardware's words

    def address(self, node: str) -> str:
        return self.addresses.get(node, node)


def uses_allocation(launcher: str) -> bool:
    return launcher.lower() in SLURM_LAUNCHERS


def require_job(environ: dict[str, str]) -> str:
    """The job id, or the one-line refusal of a launch outside any allocation."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        raise UsageError("--launcher slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run it inside "
                         "salloc or sbatch, or use --launcher ssh with a --hostfile")
    return job_id


def parse_hostnames(text: str) -> tuple[str, ...]:
    """`scontrol show hostnames`'s output: one node name a line."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def parse_node_addresses(text: str) -> dict[str, str]:
    """`scontrol show node -o`'s output, one node a line: NodeName -> NodeAddr."""
    return {match.group(1): match.group(2) for match in map(_NODE_ADDR.search, text.splitlines()) if match}


# What a node's experiments run on (steady fields only: nothing of its load or state), for the
# tuning run's fingerprint: a resume in an allocation of other hardware is not fed these records.
HARDWARE_FIELDS = ("Arch", "CPUTot", "RealMemory", "Gres", "AvailableFeatures")


def parse_node_hardware(text: str) -> dict[str, str]:
    """`scontrol show node -o`'s output: NodeName -> its hardware in words (HARDWARE_FIELDS)."""
    hardware = {}
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        if name:
            found = (re.search(rf"(?:^|\s){key}=(\S+)", line) for key in HARDWARE_FIELDS)
            hardware[name.group(1)] = " ".join(f"{key}={m.group(1)}" for key, m in zip(HARDWARE_FIELDS, found) if m)
    return hardware


def hardware_summary(allocation: "Allocation") -> str:
    """The allocation's nodes' hardware in one line, each kind with its count (which nodes does not
    matter: a new allocation of the same kind of nodes resumes a tune)."""
    counts: dict[str, int] = {}
    for node in allocation.nodes:
        kind = allocation.hardware.get(node, "unknown")
        counts[kind] = counts.get(kind, 0) + 1
    return "slurm nodes: " + "; ".join(f"{count}x {kind}" for kind, count in sorted(counts.items()))


def ranks_per_node(environ: dict[str, str]) -> int | None:
    """GPUs per node that Slurm gave the job, when it says (salloc/sbatch --gpus-per-node=[TYPE:]N,
    or the batch script's SLURM_GPUS_ON_NODE); None leaves the choice to the launcher's default."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        match = _GPU_COUNT.search(environ.get(key, "").strip())
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return None


def allocation_pool(allocation: Allocation, slots_per_node: int, hostfile: str | None = None,
                    hostfile_pool: dict[str, int] | None = None) -> dict[str, int]:
    """The hosts to choose from: every node of the allocation, or a hostfile's hosts (its order
    and slots, as DeepSpeed reads it), which must all be nodes of the allocation."""
    if hostfile_pool is None:
        return {node: slots_per_node for node in allocation.nodes}
    outside = [host for host in hostfile_pool if host not in allocation.nodes]
    if outside:
        raise UsageError(f"--hostfile {hostfile}: lists hosts outside this Slurm allocation (job {allocation.job_id}: "
                         f"{allocation.nodelist}): {', '.join(outside)}; list only its nodes, or drop --hostfile "
                         "to use them all")
    return dict(hostfile_pool)


def check_whole_slots(hosts: dict[str, list[int]]) -> None:
    """srun gives a step the node's devices, not chosen ones: only the first N slots of a node can
    be honoured (the agent's local ranks 0..N-1)."""
    for host, slots in hosts.items():
        if slots != list(range(len(slots))):
            raise UsageError(f"--include/--exclude: slots {slots} on {host}; under --launcher slurm each node runs its "
                             "first N slots (Slurm picks the devices), so name whole nodes, e.g. --include "
                             f"{host}, or use --nproc_per_node")


def _scontrol(args: tuple[str, ...], environ: dict[str, str], run) -> str:
    try:
        result = run(["scontrol", *args], env=environ, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UsageError("--launcher slurm: scontrol is not on PATH; it is needed to read the allocation's "
                         "nodes") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"--launcher slurm: `scontrol {' '.join(args)}` did not answer in 60 s") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"status {result.returncode}"])[-1]
        raise LaunchError(f"--launcher slurm: `scontrol {' '.join(args)}` failed: {last}")
    return result.stdout


def read_allocation(environ: dict[str, str], run=subprocess.run) -> Allocation:
    """The allocation this process runs in, asked of scontrol (two calls, whatever the node count)."""
    job_id = require_job(environ)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError(f"--launcher slurm: SLURM_JOB_NODELIST is not set in job {job_id}; run the launcher "
                         "in the allocation's own shell (salloc, or the sbatch script)")
    nodes = parse_hostnames(_scontrol(("show", "hostnames", nodelist), environ, run))
    if not nodes:
        raise LaunchError(f"--launcher slurm: scontrol expanded {nodelist} to no node names")
    # NodeAddr: a failure here is not fatal, the names are the addresses on most clusters.
    try:
        shown = _scontrol(("show", "node", "-o", nodelist), environ, run)
    except LaunchError:
        shown = ""
    return Allocation(job_id, nodelist, nodes, parse_node_addresses(shown), parse_node_hardware(shown))
