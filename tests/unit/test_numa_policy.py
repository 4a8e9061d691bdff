"""--bind_cores_to_rank's memory policy (autotuner/launch/numa.py) against DeepSpeed's own numactl
prefix (deepspeed/utils/numa.py) on the NUMA layouts it distinguishes. A real rank applies it in
tests/integration/test_deepspeed_api.py."""

from __future__ import annotations

from unittest import mock

import pytest

from autotuner.launch.core_binding import core_binding, cores_for_ranks
from autotuner.launch.numa import MemoryPolicy, memory_policy_for, numa_node_cpus

LAYOUTS = {
    "one node": {0: [0, 1, 2, 3]},
    "two sockets": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
    "interleaved CPUs": {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]},
    "flat HBM": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [], 3: []},
    "flat HBM, quadrant": {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [], 5: [], 6: [], 7: []},
    "an HBM node short": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: []},  # not flat HBM: normal
    "fake NUMA": {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [4, 5, 6, 7]},
    "fake NUMA on one socket": {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [4, 5, 6, 7]},
}


def deepspeeds_policy(layout: dict[int, list[int]], core_list: str, ranks: int, rank: int) -> MemoryPolicy | None:
    """The memory flag of DeepSpeed's numactl prefix for one local rank, read back as a policy."""
    numa = pytest.importorskip("deepspeed.utils.numa")
    cores_by_node = [layout[node] for node in sorted(layout)]
    with mock.patch.object(numa, "get_numa_cores", return_value=cores_by_node), \
            mock.patch.object(numa, "check_for_numactl_pkg", return_value=True):
        _, command = numa.get_numactl_cmd(core_list, ranks, rank)
    for flag, mode in (("-m", "bind"), ("-p", "prefer")):
        if flag in command:
            return MemoryPolicy(mode, tuple(int(n) for n in command[command.index(flag) + 1].split(",")))
    return None


def _cores(nodes: dict[int, list[int]]) -> list[int]:
    return sorted({cpu for cpus in nodes.values() for cpu in cpus})


# Each layout with 1, 2, 4 and 8 ranks where it has a core for each (fewer are refused before any
# policy: test_deepspeed_api).
@pytest.mark.parametrize("layout, ranks", [(layout, ranks) for layout in sorted(LAYOUTS) for ranks in (1, 2, 4, 8)
                                           if ranks <= len(_cores(LAYOUTS[layout]))])
def test_each_ranks_memory_policy_is_deepspeeds(layout, ranks):
    nodes = LAYOUTS[layout]
    cores = _cores(nodes)
    core_list = ",".join(map(str, cores))
    for rank, group in enumerate(cores_for_ranks(cores, ranks)):
        assert memory_policy_for(group, nodes) == deepspeeds_policy(nodes, core_list, ranks, rank), (layout, rank)


def test_the_modes_deepspeed_distinguishes():
    assert memory_policy_for([4, 5], LAYOUTS["two sockets"]) == MemoryPolicy("bind", (1,))
    assert memory_policy_for([3, 4], LAYOUTS["two sockets"]) is None  # spans two nodes: unbound, as DeepSpeed
    assert memory_policy_for([4, 5], LAYOUTS["flat HBM"]) == MemoryPolicy("prefer", (3,))  # its node's HBM
    assert memory_policy_for([2, 3], LAYOUTS["flat HBM, quadrant"]) == MemoryPolicy("prefer", (5,))
    assert memory_policy_for([4, 5], LAYOUTS["an HBM node short"]) == MemoryPolicy("bind", (1,))
    assert memory_policy_for([4, 5], LAYOUTS["fake NUMA"]) == MemoryPolicy("bind", (2, 3))
    # A node that repeats no other is no fake-NUMA run: DeepSpeed leaves its ranks unbound there.
    assert memory_policy_for([4, 5], LAYOUTS["fake NUMA on one socket"]) is None
    assert MemoryPolicy.parse("bind:2,3") == MemoryPolicy("bind", (2, 3)) and MemoryPolicy("prefer", (5,)).text == "prefer:5"
    with pytest.raises(ValueError):
        MemoryPolicy("prefer", (1, 2))  # numactl -p takes one node


def test_the_kernels_node_list_is_read_with_memory_only_nodes(tmp_path):
    for node, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15"), (2, ""), (3, "")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    nodes = numa_node_cpus(tmp_path)
    assert nodes == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15], 2: [], 3: []}
    binding = core_binding("0-1,4-5", 2, list(range(16)), nodes, libnuma=True)
    assert binding.entry_flags == ("--core_groups", "0,1;4,5", "--memory_policies", "prefer:2;prefer:3")
    unbound = core_binding("3-4", 1, list(range(16)), nodes, libnuma=False)  # spans nodes: nothing to say
    assert unbound.entry_flags == ("--core_groups", "3,4") and unbound.notes == ()
    missing = core_binding("0-1", 1, list(range(16)), nodes, libnuma=False)
    assert "libnuma not found" in missing.notes[0]
