"""The head's plan to start one agent per host from a DeepSpeed hostfile, as data: which hosts and
slots, the ssh and srun commands, what is exported, and what is refused."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from autotuner.core.errors import UsageError
from autotuner.launch.nodes import STOP_WITH_STDIN_FLAG, active_hosts, exported_env, nodes_plan, plan_nodes
from autotuner.launch.options import LaunchOptions
from autotuner.launch.slurm import Allocation

PY = "/opt/py/bin/python"


@pytest.fixture
def hostfile(tmp_path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# cluster\nworker-0 slots=4\nworker-1 slots=4\n\nworker-2 slots=2\n")
    return path


def plan(hostfile, tmp_path, **overrides):
    fields = dict(hostfile=str(hostfile), include=None, exclude=None, num_nodes=None, nproc_per_node=None,
                  master_addr=None, master_port=29500, launcher="pdsh", ssh_port=None, passthrough=(),
                  script="train.py", script_args=("--deepspeed", "ds.json"), python=PY, cwd=str(tmp_path),
                  environ={"PATH": "/bin", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "HOME_ONLY": "x"},
                  home=str(tmp_path / "home"))
    return plan_nodes(**{**fields, **overrides})


def remote_words(cmd: tuple[str, ...]) -> list[str]:
    """The words ssh's remote shell would run, split as that shell splits them."""
    assert cmd[:3] == ("ssh", "-o", "BatchMode=yes")
    return shlex.split(cmd[-1])


def test_every_host_gets_an_agent_with_its_rank_and_slots(hostfile, tmp_path):
    nodes = plan(hostfile, tmp_path)
    assert nodes.backend == "ssh" and nodes.master_addr == "worker-0" and nodes.world_size == 10
    assert [(n.host, n.node_rank, n.nproc) for n in nodes.nodes] == [("worker-0", 0, 4), ("worker-1", 1, 4),
                                                                      ("worker-2", 2, 2)]
    words = remote_words(nodes.nodes[1].cmd)
    assert nodes.nodes[1].cmd[3] == "worker-1"
    assert words[:3] == ["cd", str(tmp_path), "&&"] and words[3] == "env"
    agent = words[words.index(PY):]
    assert agent == [PY, "-u", "-m", "autotuner", "--num_nodes", "3", "--node_rank", "1", "--nproc_per_node", "4",
                     "--master_addr", "worker-0", "--master_port", "29500", STOP_WITH_STDIN_FLAG, "train.py",
                     "--deepspeed", "ds.json"]


def test_user_input_never_becomes_shell_syntax(hostfile, tmp_path):
    nasty = ("--note", "x; rm -rf / #", "$(reboot)", "a b'c\"d")
    nodes = plan(hostfile, tmp_path, script_args=nasty)
    words = remote_words(nodes.nodes[0].cmd)
    assert tuple(words[-4:]) == nasty  # each arrives as one word, unexpanded


def test_include_and_exclude_pick_hosts_and_devices(hostfile, tmp_path):
    nodes = plan(hostfile, tmp_path, include="worker-1:0,2@worker-2")
    assert [(n.host, n.node_rank, n.nproc) for n in nodes.nodes] == [("worker-1", 0, 2), ("worker-2", 1, 2)]
    assert nodes.master_addr == "worker-1"
    assert "CUDA_VISIBLE_DEVICES=0,2" in remote_words(nodes.nodes[0].cmd)
    assert "CUDA_VISIBLE_DEVICES=0,1" in remote_words(nodes.nodes[1].cmd)
    nodes = plan(hostfile, tmp_path, exclude="worker-0@worker-2:1")
    assert [(n.host, n.nproc) for n in nodes.nodes] == [("worker-1", 4), ("worker-2", 1)]


def test_num_nodes_and_num_gpus_trim_the_pool_as_deepspeed_does(hostfile, tmp_path):
    assert active_hosts(str(hostfile), None, None, 2, None) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert active_hosts(str(hostfile), None, None, None, 1) == {h: [0] for h in ("worker-0", "worker-1", "worker-2")}
    with pytest.raises(UsageError, match="--num_nodes: got 4"):
        active_hosts(str(hostfile), None, None, 4, None)
    with pytest.raises(UsageError, match="--include/--exclude"):
        active_hosts(str(hostfile), "worker-0", None, 2, None)


def test_exports_follow_deepspeeds_prefixes_and_deepspeed_env_files(hostfile, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nFROM_HOME=1\n")
    (tmp_path / ".deepspeed_env").write_text("# here\nFROM_HOME=2\nWITH_EQUALS=a=b\n")
    env = exported_env({"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "UCX_TLS": "tcp", "SECRET": "s"},
                       str(tmp_path), str(tmp_path / "home"))
    assert env == {"NCCL_DEBUG": "INFO", "PYTHONPATH": f"{tmp_path}:/src", "UCX_TLS": "tcp",
                   "NCCL_SOCKET_IFNAME": "eth0", "FROM_HOME": "2", "WITH_EQUALS": "a=b"}
    (tmp_path / ".deepspeed_env").write_text("NOT AN ASSIGNMENT\n")
    with pytest.raises(UsageError, match=r"\.deepspeed_env:1"):
        exported_env({}, str(tmp_path), str(tmp_path / "home"))


WORKERS = Allocation("42", "worker-[0-2]", ("worker-0", "worker-1", "worker-2"),
                     {"worker-0": "10.0.0.10", "worker-1": "10.0.0.11", "worker-2": "10.0.0.12"})


def test_srun_starts_one_job_step_per_node_with_exports_in_its_environment(hostfile, tmp_path):
    environ = {"SLURM_JOB_ID": "42", "NCCL_DEBUG": "INFO"}
    nodes = plan(hostfile, tmp_path, launcher="slurm", environ=environ, allocation=WORKERS)
    assert nodes.backend == "srun"
    node = nodes.nodes[2]
    assert node.cmd[:9] == ("srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=worker-2",
                            "--export=ALL", f"--chdir={tmp_path}", "--kill-on-bad-exit=1", PY)
    assert node.cmd[node.cmd.index("--node_rank") + 1] == "2"
    assert node.env["NCCL_DEBUG"] == "INFO" and node.env["PYTHONPATH"] == str(tmp_path)
    # Rendezvous at the first node's NodeAddr: a node's name need not resolve.
    assert nodes.master_addr == "10.0.0.10"
    assert node.cmd[node.cmd.index("--master_addr") + 1] == "10.0.0.10"
    with pytest.raises(UsageError, match="SLURM_JOB_ID"):
        plan(hostfile, tmp_path, launcher="slurm", environ={}, allocation=WORKERS)


def test_every_host_is_checked_over_ssh_first_unless_told_not_to(hostfile, tmp_path):
    nodes = plan(hostfile, tmp_path, ssh_port=2222)
    assert nodes.checks == tuple(("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", "2222", host, "true")
                                 for host in ("worker-0", "worker-1", "worker-2"))
    assert plan(hostfile, tmp_path, ssh_check_hosts=False).checks == ()
    assert plan(hostfile, tmp_path, launcher="slurm", environ={"SLURM_JOB_ID": "42"}, allocation=WORKERS).checks == ()


def test_ssh_port_and_unsupported_backends(hostfile, tmp_path):
    assert plan(hostfile, tmp_path, ssh_port=2222).nodes[0].cmd[3:6] == ("-p", "2222", "worker-0")
    with pytest.raises(UsageError, match="--launcher: got 'openmpi'"):
        plan(hostfile, tmp_path, launcher="openmpi")


def test_a_hostfile_of_only_this_host_starts_ranks_here(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    local = tmp_path / "hostfile"
    local.write_text("localhost slots=2\n")
    options = LaunchOptions(script=str(script), hostfile=str(local))
    assert nodes_plan(options, PY, str(tmp_path), {}, num_nodes=None) is None
    remote = tmp_path / "hostfile2"
    remote.write_text("localhost slots=2\nworker-1 slots=2\n")
    options = LaunchOptions(script=str(script), hostfile=str(remote), bind_cores_to_rank=True, rdzv_conf="timeout=9")
    nodes = nodes_plan(options, PY, str(tmp_path), {}, num_nodes=None, agent_flags=("--debug",))
    words = remote_words(nodes.nodes[1].cmd)
    assert words[words.index(STOP_WITH_STDIN_FLAG) + 1:] == ["--debug", "--rdzv_conf", "timeout=9",
                                                               "--bind_cores_to_rank", str(script)]
    with pytest.raises(UsageError, match="--node_rank"):
        nodes_plan(LaunchOptions(script=str(script), hostfile=str(remote), node_rank=1), PY, str(tmp_path), {},
                   num_nodes=None)
