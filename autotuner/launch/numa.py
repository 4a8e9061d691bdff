"""Where a bound rank's memory goes under --bind_cores_to_rank: DeepSpeed's NUMA modes. Pure but
for reading the kernel's node list.

DeepSpeed's launcher prefixes each rank with numactl and picks the memory policy from the
machine's NUMA layout (deepspeed/utils/numa.py, 0.19.8):
- normal: bind (`numactl -m N`) to the node holding all of the rank's cores; none where they span
  nodes;
- flat HBM, where as many nodes hold no CPUs (high-bandwidth memory exposed as nodes of its own)
  as hold some: prefer (`numactl -p H`) the memory-only node paired with the rank's node in node
  order, so allocations spill to DDR once the HBM is full;
- fake NUMA (a node split into several that list the same CPUs, consecutively): bind to every
  node of that run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotuner.launch.resources import parse_core_list
from autotuner.core.errors import UsageError

MODES = ("bind", "prefer")  # numactl -m, numactl -p


@dataclass(frozen=True)
class MemoryPolicy:
    """One rank's memory policy: `mode` over NUMA `nodes`."""

    mode: str
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.mode not in MODES or not self.nodes or (self.mode == "prefer" and len(self.nodes) != 1):
            raise ValueError(f"memory policy {self.mode}:{self.nodes}: expected bind over nodes or prefer one node")

    @property
    def text(self) -> str:
        """'bind:0,1' or 'prefer:2': rank_entry's --memory_policies entry."""
        return f"{self.mode}:{','.join(map(str, self.nodes))}"

    @classmethod
    def parse(cls, text: str) -> "MemoryPolicy":
        mode, _, nodes = text.partition(":")
        return cls(mode, tuple(int(node) for node in nodes.split(",")))


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


def _fake_numa_runs(nodes: dict[int, list[int]]) -> list[list[int]]:
    """Runs of consecutive nodes that list the same CPUs (a node with none ends a run only at the
    next node that has some, as in DeepSpeed's scan)."""
    runs: list[list[int]] = []
    current: list[int] = []
    previous_node, previous_cpus = None, None
    for node, cpus in nodes.items():
        if cpus:
            if cpus == previous_cpus:
                current = current or [previous_node]
                current.append(node)
            elif current:
                runs.append(current)
                current = []
        previous_node, previous_cpus = node, cpus
    return runs + [current] if current else runs


def memory_policy_for(cores: list[int], nodes: dict[int, list[int]]) -> MemoryPolicy | None:
    """The memory policy DeepSpeed's launcher gives a rank on `cores`, or None where it gives none."""
    holding = [node for node, cpus in nodes.items() if cpus and set(cores) <= set(cpus)]
    memory_only = [node for node, cpus in nodes.items() if not cpus]
    with_cpus = [node for node, cpus in nodes.items() if cpus]
    if memory_only and len(memory_only) == len(with_cpus):  # flat HBM
        pairs = dict(zip(with_cpus, memory_only))
        return MemoryPolicy("prefer", (pairs[holding[0]],)) if holding else None
    runs = _fake_numa_runs(nodes)
    if runs:
        run = next((run for node in holding for run in runs if node in run), None)
        return MemoryPolicy("bind", tuple(run)) if run else None
    return MemoryPolicy("bind", (holding[0],)) if holding else None
