"""The `deepspeed` launcher's resource flags, as pure functions: hostfile, --include/--exclude,
and --bind_cores_to_rank's split of cores. Parsing rules and messages follow DeepSpeed's runner."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autotuner.core.errors import UsageError

DEFAULT_HOSTFILE = "/job/hostfile"
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def default_hostfile(exists: bool, *, starts_one_node: bool) -> str | None:
    """DeepSpeed's launcher reads /job/hostfile when no --hostfile is given (DLTS and Azure ML
    write it), and trains on its hosts. So do we, where it exists, unless this command starts one
    node of a job itself (--node_rank, --master_addr, --rdzv_endpoint: torchrun's way, and what
    our head gives each node's agent), which a hostfile would contradict."""
    return DEFAULT_HOSTFILE if exists and not starts_one_node else None


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """`host slots=N` per line, `#` comments; hosts in file order."""
    pool: dict[str, int] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.match(line)
        if not match:
            raise UsageError(f"--hostfile {path}: bad entry {line!r}; expected lines like 'worker-0 slots=4'")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise UsageError(f"--hostfile {path}: {host} is listed twice; give each host once")
        pool[host] = slots
    if not pool:
        raise UsageError(f"--hostfile {path}: no 'host slots=N' entries; the file is empty or not in that format")
    return pool


def is_this_host(host: str) -> bool:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names


def _parse_spec(text: str, flag: str) -> dict[str, list[int]]:
    """`host1:0,1@host2` -> {host1: [0, 1], host2: []} (an empty list means every slot)."""
    wanted: dict[str, list[int]] = {}
    for spec in text.split("@"):
        spec = spec.strip()
        if not spec:
            raise UsageError(f"{flag}: got {text!r}; expected NODE[:SLOT[,SLOT...]][@NODE...], e.g. localhost:0,1")
        host, _, slots = spec.partition(":")
        try:
            ids = [int(slot) for slot in slots.split(",")] if slots else []
        except ValueError:
            raise UsageError(f"{flag}: got {text!r}; slots must be integers, e.g. localhost:0,1") from None
        wanted.setdefault(host, [])
        wanted[host] = sorted(set(wanted[host] + ids)) if ids or wanted[host] else []
    return wanted


def select_slots(pool: dict[str, int], include: str | None, exclude: str | None,
                 check_include_range: bool = True) -> dict[str, list[int]]:
    """DeepSpeed's resource filter: the slot ids each host keeps, hosts in pool order, empty hosts dropped."""
    if include and exclude:
        raise UsageError("--include and --exclude are mutually exclusive; give one")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if not include and not exclude:
        return active
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    wanted = _parse_spec(text, flag)
    for host, slots in wanted.items():
        if host not in pool:
            raise UsageError(f"{flag}: host '{host}' is not in the resource pool ({', '.join(pool)})")
        if include and not check_include_range:
            continue  # DeepSpeed's CPU accelerator: slots count ranks, not devices
        for slot in slots:
            if slot not in active[host]:
                raise UsageError(f"{flag}: no slot {slot} on host '{host}' (it has slots 0..{pool[host] - 1})")
    if include:
        chosen = {host: (wanted[host] or active[host]) for host in pool if host in wanted}
    else:
        chosen = {host: [s for s in active[host] if wanted.get(host) and s not in wanted[host]]
                  if host in wanted else active[host] for host in pool}
    return {host: slots for host, slots in chosen.items() if slots}


def parse_core_list(text: str) -> list[int]:
    """`1,3-5,7` -> [1, 3, 4, 5, 7]; ranges ascending and not overlapping, as DeepSpeed requires."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high) if high else int(low)
            if last < first or (cores and first <= cores[-1]):
                raise ValueError
            cores.extend(range(first, last + 1))
    except ValueError:
        raise UsageError(f"--bind_core_list: got {text!r}; expected ascending cores and ranges like 0,2-5,8") from None
    return cores


def one_cpu_per_core(cpus: list[int], siblings_of: Callable[[int], str | None] | None = None) -> list[int]:
    """Of `cpus`, the first hardware thread of each physical core: what --bind_cores_to_rank without
    a core list divides, as DeepSpeed divides the physical core count (hyperthread siblings left
    idle, so a rank's threads do not share a core's units). `siblings_of(cpu)` reads the kernel's
    thread_siblings_list ('0,16' or '0-1'); unreadable, each CPU counts as a core."""
    siblings_of = siblings_of or _thread_siblings
    chosen, covered = [], set()
    for cpu in sorted(cpus):
        if cpu in covered:
            continue
        text = siblings_of(cpu)
        try:
            covered.update(parse_core_list(text) if text else [cpu])
        except UsageError:
            covered.add(cpu)
        chosen.append(cpu)
    return chosen


def _thread_siblings(cpu: int) -> str | None:
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None


def numa_node_cpus(root: str | Path = "/sys/devices/system/node") -> dict[int, list[int]]:
    """Each NUMA node's CPUs, as the kernel lists them (a memory-only node, HBM say, lists none)."""
    nodes: dict[int, list[int]] = {}
    for path in Path(root).glob("node[0-9]*/cpulist"):
        text = path.read_text().strip()
        try:
            nodes[int(path.parent.name[len("node"):])] = parse_core_list(text) if text else []
        except UsageError:
            continue
    return dict(sorted(nodes.items()))


def memory_node_for(cores: list[int], nodes: dict[int, list[int]]) -> int | None:
    """The NUMA node whose memory a rank on `cores` is bound to, as DeepSpeed's `numactl -m`: the
    node holding all of them. None where they span nodes, or where nodes repeat one CPU list (fake
    NUMA) or hold no CPUs (flat HBM), modes DeepSpeed binds otherwise and we leave unbound."""
    if any(not cpus for cpus in nodes.values()) or len({tuple(c) for c in nodes.values()}) < len(nodes):
        return None
    return next((node for node, cpus in nodes.items() if set(cores) <= set(cpus)), None)


@dataclass(frozen=True)
class CoreBinding:
    """--bind_cores_to_rank's plan for one node: rank_entry's flags, each rank's thread count, and
    what the launcher tells the user."""

    entry_flags: tuple[str, ...]
    threads_per_rank: int
    notes: tuple[str, ...] = ()


def core_binding(bind_core_list: str | None, nproc: int, allowed: list[int], numa: dict[int, list[int]],
                 libnuma: bool) -> CoreBinding:
    """DeepSpeed's split of the cores (the list given, else one hardware thread of each physical
    core this process may use) over the local ranks, and each rank's memory on the NUMA node of its
    cores where libnuma can bind it."""
    cores = parse_core_list(bind_core_list) if bind_core_list else one_cpu_per_core(allowed)
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise UsageError(f"--bind_core_list: cores {outside} are not available to this process (it may use {allowed})")
    groups = cores_for_ranks(cores, nproc)
    flags = ["--core_groups", ";".join(",".join(map(str, group)) for group in groups)]
    notes: tuple[str, ...] = ()
    memory_nodes = [memory_node_for(group, numa) for group in groups]
    if any(node is not None for node in memory_nodes):
        if libnuma:
            flags += ["--memory_nodes", ";".join("" if node is None else str(node) for node in memory_nodes)]
        else:
            notes = ("--bind_cores_to_rank: libnuma not found, so each rank's memory is not bound to its NUMA node "
                     "(DeepSpeed's launcher needs numactl, which brings it: install numactl)",)
    return CoreBinding(tuple(flags), len(groups[0]), notes)


def cores_for_ranks(cores: list[int], nproc: int) -> list[list[int]]:
    """DeepSpeed's even split: each local rank gets len(cores) // nproc consecutive cores; the
    remainder stays unused."""
    per_rank = len(cores) // nproc
    if per_rank < 1:
        raise UsageError(f"--bind_cores_to_rank: {len(cores)} core(s) for {nproc} ranks per node; each rank needs "
                         "at least one (use fewer ranks or a longer --bind_core_list)")
    return [cores[per_rank * rank: per_rank * (rank + 1)] for rank in range(nproc)]
