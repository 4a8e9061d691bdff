"""The `deepspeed` launcher's resource flags, as pure functions: hostfile, --include/--exclude,
and --bind_core_list's syntax (core_binding.py splits the cores). Parsing rules and messages
follow DeepSpeed's runner."""

from __future__ import annotations

import re
import socket
from pathlib import Path

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
