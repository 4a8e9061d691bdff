"""--launcher slurm's nodes, as data: the allocation read from scontrol's output (a fake runner
here), narrowed by a hostfile, --include/--exclude and --num_nodes, and the one-line refusals."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from autotuner.core.errors import LaunchError, UsageError
from autotuner.launch.nodes import nodes_plan, slurm_hosts
from autotuner.launch.options import LaunchOptions
from autotuner.launch.slurm import (Allocation, hardware_summary, parse_hostnames, parse_node_addresses,
                                    parse_node_hardware, ranks_per_node, read_allocation)

PY = "/opt/py/bin/python"
SHOW_NODE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 CPUTot=2 Gres=(null) NodeAddr=127.0.0.1 "
    "NodeHostName=vm Port=6818 Version=22.05.8 State=MIXED Partitions=debug\n"
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 CPUTot=2 Gres=(null) NodeAddr=127.0.0.1 "
    "NodeHostName=vm Port=6819 Version=22.05.8 State=MIXED Partitions=debug\n")
ALLOCATION = Allocation("7", "node[1-3]", ("node1", "node2", "node3"),
                        {"node1": "10.1.0.1", "node2": "10.1.0.2", "node3": "10.1.0.3"})
IN_JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]"}


class FakeScontrol:
    """subprocess.run's stand-in: answers `scontrol show hostnames|node` and records the calls."""

    def __init__(self, hostnames="node1\nnode2\n", show_node=SHOW_NODE, node_status=0):
        self.hostnames, self.show_node, self.node_status, self.calls = hostnames, show_node, node_status, []

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        if argv[1:3] == ["show", "hostnames"]:
            return SimpleNamespace(returncode=0, stdout=self.hostnames, stderr="")
        return SimpleNamespace(returncode=self.node_status, stdout=self.show_node,
                               stderr="" if self.node_status == 0 else "slurm_load_node error: Unable to contact")


def test_scontrol_output_is_parsed_into_names_and_addresses():
    assert parse_hostnames("node1\nnode2\n\n") == ("node1", "node2")
    assert parse_node_addresses(SHOW_NODE) == {"node1": "127.0.0.1", "node2": "127.0.0.1"}
    assert parse_node_addresses("") == {}


def test_the_allocation_is_read_with_two_scontrol_calls():
    run = FakeScontrol()
    allocation = read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}, run)
    assert allocation == Allocation("7", "node[1-2]", ("node1", "node2"), {"node1": "127.0.0.1", "node2": "127.0.0.1"},
                                    parse_node_hardware(SHOW_NODE))
    assert run.calls == [["scontrol", "show", "hostnames", "node[1-2]"], ["scontrol", "show", "node", "-o", "node[1-2]"]]
    # No NodeAddr to be had: the names are the addresses, as on most clusters.
    allocation = read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}, FakeScontrol(node_status=1))
    assert allocation.address("node2") == "node2"


def test_the_nodes_hardware_is_read_without_their_load_and_counted_by_kind():
    # The fingerprint's device on --backend slurm: what the nodes are, never how busy they are, so a
    # new allocation of like nodes resumes the tune and one of other GPUs does not.
    busy = SHOW_NODE.replace("CPUAlloc=1", "CPUAlloc=2").replace("State=MIXED", "State=ALLOCATED")
    assert parse_node_hardware(busy) == parse_node_hardware(SHOW_NODE) == \
        {"node1": "Arch=x86_64 CPUTot=2 Gres=(null)", "node2": "Arch=x86_64 CPUTot=2 Gres=(null)"}
    gpus = ("NodeName=g1 Arch=x86_64 CPUTot=64 RealMemory=512000 Gres=gpu:h100:8 AvailableFeatures=h100 State=IDLE\n"
            "NodeName=g2 Arch=x86_64 CPUTot=64 RealMemory=512000 Gres=gpu:a100:8 AvailableFeatures=a100 State=IDLE\n")
    mixed = Allocation("9", "g[1-2]", ("g1", "g2"), hardware=parse_node_hardware(gpus))
    assert hardware_summary(mixed) == ("slurm nodes: 1x Arch=x86_64 CPUTot=64 RealMemory=512000 Gres=gpu:a100:8 "
                                       "AvailableFeatures=a100; 1x Arch=x86_64 CPUTot=64 RealMemory=512000 "
                                       "Gres=gpu:h100:8 AvailableFeatures=h100")
    assert hardware_summary(Allocation("9", "g1", ("g1",), hardware=parse_node_hardware(gpus))) != \
        hardware_summary(Allocation("9", "g2", ("g2",), hardware=parse_node_hardware(gpus.replace("g1", "gx"))))
    read = read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}, FakeScontrol())
    assert hardware_summary(read) == "slurm nodes: 2x Arch=x86_64 CPUTot=2 Gres=(null)"


def test_outside_an_allocation_or_with_scontrol_failing_the_launch_is_refused_in_one_line():
    with pytest.raises(UsageError, match=r"not inside a Slurm allocation \(SLURM_JOB_ID is not set\); run it inside "
                                         "salloc or sbatch"):
        read_allocation({"PATH": "/bin"}, FakeScontrol())
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST is not set in job 7"):
        read_allocation({"SLURM_JOB_ID": "7"}, FakeScontrol())

    def failing(argv, **kwargs):
        return SimpleNamespace(returncode=1, stdout="", stderr="scontrol: error: Invalid hostlist: node[")

    with pytest.raises(LaunchError, match=r"`scontrol show hostnames node\[` failed: scontrol: error: Invalid"):
        read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node["}, failing)

    def missing(argv, **kwargs):
        raise FileNotFoundError(argv[0])

    with pytest.raises(UsageError, match="scontrol is not on PATH"):
        read_allocation(IN_JOB, missing)

    def hung(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, 60)

    with pytest.raises(LaunchError, match="did not answer in 60 s"):
        read_allocation(IN_JOB, hung)


def test_ranks_per_node_come_from_the_gpus_slurm_gave():
    assert ranks_per_node({}) is None
    assert ranks_per_node({"SLURM_GPUS_PER_NODE": "a100:4"}) == 4
    assert ranks_per_node({"SLURM_GPUS_PER_NODE": "8"}) == 8
    assert ranks_per_node({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "8"}) == 2
    assert ranks_per_node({"SLURM_GPUS_ON_NODE": "0"}) is None


def hosts(**narrowing):
    fields = dict(hostfile=None, include=None, exclude=None, num_nodes=None, nproc_per_node=None, slots_per_node=2)
    return slurm_hosts(ALLOCATION, **{**fields, **narrowing})


def test_every_node_of_the_allocation_unless_narrowed():
    assert hosts() == {"node1": [0, 1], "node2": [0, 1], "node3": [0, 1]}
    assert hosts(num_nodes=2) == {"node1": [0, 1], "node2": [0, 1]}
    assert hosts(nproc_per_node=1) == {"node1": [0], "node2": [0], "node3": [0]}
    assert hosts(include="node3@node1") == {"node1": [0, 1], "node3": [0, 1]}
    assert hosts(exclude="node2") == {"node1": [0, 1], "node3": [0, 1]}
    assert hosts(include="node2:0") == {"node2": [0]}  # the first slots: honoured


def test_a_hostfile_narrows_the_allocation_in_its_own_order(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node3 slots=4\nnode1 slots=4\n")
    assert hosts(hostfile=str(hostfile)) == {"node3": [0, 1, 2, 3], "node1": [0, 1, 2, 3]}
    hostfile.write_text("node1 slots=4\nworker-9 slots=4\nlocalhost slots=1\n")
    with pytest.raises(UsageError) as refused:
        hosts(hostfile=str(hostfile))
    assert str(refused.value) == (f"--hostfile {hostfile}: lists hosts outside this Slurm allocation (job 7: "
                                  "node[1-3]): worker-9, localhost; list only its nodes, or drop --hostfile to use "
                                  "them all")


def test_more_nodes_than_the_allocation_holds_and_chosen_devices_are_refused(tmp_path):
    with pytest.raises(UsageError) as refused:
        hosts(num_nodes=4)
    assert str(refused.value) == "--num_nodes: got 4, but the Slurm allocation (job 7) holds 3 host(s)"
    with pytest.raises(UsageError, match=r"--include/--exclude: slots \[1\] on node2; under --launcher slurm"):
        hosts(include="node2:1")
    with pytest.raises(UsageError, match="host 'worker-0' is not in the resource pool"):
        hosts(include="worker-0")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return path


def slurm_plan(script, tmp_path, environ=IN_JOB, num_nodes=None, **options):
    return nodes_plan(LaunchOptions(script=str(script), launcher="slurm", **options), PY, str(tmp_path),
                      dict(environ), num_nodes=num_nodes, allocation=ALLOCATION)


def test_without_a_hostfile_slurm_runs_one_step_per_node_of_the_allocation(script, tmp_path):
    nodes = slurm_plan(script, tmp_path, num_nodes=2, nproc_per_node=3, master_port=29611,
                       slurm_comment="run 7", launcher_args="--qos high --overlap")
    assert nodes.backend == "srun" and nodes.master_addr == "10.1.0.1" and nodes.world_size == 6
    assert [(n.host, n.node_rank, n.nproc) for n in nodes.nodes] == [("node1", 0, 3), ("node2", 1, 3)]
    cmd = nodes.nodes[1].cmd
    assert cmd[cmd.index("--kill-on-bad-exit=1") + 1:cmd.index(PY)] == ("--comment=run 7", "--qos", "high",
                                                                         "--overlap")
    agent = cmd[cmd.index(PY):]
    assert agent[agent.index("--num_nodes"):agent.index("--stop_with_stdin")] == (
        "--num_nodes", "2", "--node_rank", "1", "--nproc_per_node", "3", "--master_addr", "10.1.0.1",
        "--master_port", "29611")
    # One node is still a job step: salloc's shell may run on a login node, not on the allocation's node.
    assert len(slurm_plan(script, tmp_path, num_nodes=1).nodes) == 1
    # Slots without --nproc_per_node: the GPUs per node Slurm gave the job.
    nodes = slurm_plan(script, tmp_path, environ={**IN_JOB, "SLURM_GPUS_PER_NODE": "h100:4"})
    assert [n.nproc for n in nodes.nodes] == [4, 4, 4]


def test_slurm_plans_refuse_in_one_line(script, tmp_path):
    with pytest.raises(UsageError, match="not inside a Slurm allocation"):
        slurm_plan(script, tmp_path, environ={})
    with pytest.raises(UsageError, match="--launcher slurm starts every node itself: drop --node_rank"):
        slurm_plan(script, tmp_path, node_rank=1, num_nodes=2)
    with pytest.raises(UsageError, match=r"--launcher_args: got '--comment \"x'"):
        slurm_plan(script, tmp_path, launcher_args='--comment "x')
    with pytest.raises(UsageError, match="--slurm_comment: only with --launcher slurm"):
        nodes_plan(LaunchOptions(script=str(script), slurm_comment="x"), PY, str(tmp_path), {}, num_nodes=None)
    missing = slurm_plan(script, tmp_path, hostfile=str(tmp_path / "absent"), nproc_per_node=1)
    assert missing.notes == (f"--hostfile {tmp_path / 'absent'}: not found; using every node of the Slurm "
                             "allocation",) and len(missing.nodes) == 3
