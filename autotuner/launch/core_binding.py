"""--bind_cores_to_rank's plan: DeepSpeed's split of the cores over a node's local ranks, and each
rank's memory policy (numa.py). Pure but for reading the kernel's CPU topology."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autotuner.core.errors import UsageError
from autotuner.launch.numa import memory_policy_for
from autotuner.launch.resources import parse_core_list


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
    core this process may use) over the local ranks, and each rank's memory policy by the NUMA
    layout, as DeepSpeed's numactl prefix sets it, where libnuma can apply it."""
    cores = parse_core_list(bind_core_list) if bind_core_list else one_cpu_per_core(allowed)
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise UsageError(f"--bind_core_list: cores {outside} are not available to this process (it may use {allowed})")
    groups = cores_for_ranks(cores, nproc)
    flags = ["--core_groups", ";".join(",".join(map(str, group)) for group in groups)]
    notes: tuple[str, ...] = ()
    policies = [memory_policy_for(group, numa) for group in groups]
    if any(policy is not None for policy in policies):
        if libnuma:
            flags += ["--memory_policies", ";".join("" if policy is None else policy.text for policy in policies)]
        else:
            notes = ("--bind_cores_to_rank: libnuma not found, so each rank's memory is not bound to its NUMA node(s) "
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
