"""Multi-node launches with real agents: two launchers on loopback, one per simulated node, as a
user starts them on two hosts (static rendezvous with --master_addr, or c10d with
--rdzv_endpoint). The losses must equal those of one node with two ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autotuner.config import read_config_file
from conftest import CONFIGS, MINIMAL, ROOT, launcher_env, run_launcher
from process_checks import assert_pids_dead, pids_in, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
GPT2 = ROOT / "examples" / "hf_gpt2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_agent(node_flags: tuple[str, ...], script_and_args: tuple, log: Path, cwd: Path) -> subprocess.Popen:
    """One node's launcher, in its own session so a test failure can end it with its ranks."""
    handle = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "autotuner", *node_flags, *map(str, script_and_args)],
                            cwd=cwd, env=launcher_env(), stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_two_nodes(rendezvous: str, script_and_args: tuple, tmp_path: Path, timeout: float = 240) -> list[str]:
    """Start node 1's agent, then node 0's; wait for both; return their outputs (node 0 first)."""
    port = free_port()
    if rendezvous == "static":
        common = ("--num_nodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port))
        flags = [(*common, "--node_rank", str(rank)) for rank in (0, 1)]
    else:
        common = ("--num_nodes", "2", "--nproc_per_node", "1", "--rdzv_endpoint", f"127.0.0.1:{port}",
                  "--rdzv_id", "two-agent-test")
        flags = [common, common]
    agents = []
    try:
        for rank in (1, 0):
            agents.append((rank, start_agent(flags[rank], script_and_args, tmp_path / f"node{rank}.log", tmp_path)))
        for rank, agent in agents:
            assert agent.wait(timeout=timeout) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    finally:
        for _, agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]


def minimal_args(stage: str, losses: Path) -> tuple:
    return (MINIMAL, "--deepspeed", CONFIGS / f"zero{stage}.json", "--steps", "8", "--losses_out", losses)


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory):
    """One node's two-rank losses at a ZeRO stage, launched once for the module, by (and under the
    orphan check of) the first test that asks: the static agents and the hostfile test compare with
    the same stage-0 run."""
    cache: dict[str, list[float]] = {}

    def losses(stage: str) -> list[float]:
        if stage not in cache:
            path = tmp_path_factory.mktemp(f"one_node_zero{stage}") / "one_node.json"
            single = run_launcher("--nproc_per_node", "2", *minimal_args(stage, path), cwd=path.parent)
            assert single.returncode == 0, single.stderr[-3000:]
            cache[stage] = json.loads(path.read_text())
        return cache[stage]

    return losses


# Each rendezvous once: static with DDP, c10d with FSDP2 (the engine's stages on one node are
# test_engine_multirank's; here what matters is that two agents make one world).
@pytest.mark.parametrize("rendezvous, stage", [("static", "0"), ("c10d", "2")])
def test_two_agents_on_loopback_train_as_one_node_with_two_ranks(rendezvous, stage, tmp_path, one_node_losses,
                                                                no_orphans):
    expected = one_node_losses(stage)
    two_nodes = tmp_path / "two_nodes.json"
    outputs = run_two_nodes(rendezvous, minimal_args(stage, two_nodes), tmp_path)
    got = json.loads(two_nodes.read_text())
    assert len(got) == 8 and len(set(got)) > 1
    # The same world (2 ranks, same data shards, same reduction): the same losses.
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert not any("Traceback" in out for out in outputs)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_an_endpoint_rendezvous_numbers_the_nodes_as_its_backend_says(backend, tmp_path, no_orphans):
    # torchrun's default backend with --rdzv_endpoint is static: --node_rank numbers the nodes,
    # whichever starts first (node 1 here). With c10d the nodes are numbered as they join, and
    # CROSS_RANK (DeepSpeed's) must follow GROUP_RANK (it said the --node_rank default, 0, on both).
    # Each rank also checks a module in the working directory does not shadow its imports.
    (tmp_path / "module_in_the_working_directory.py").write_text("")
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    common = ("--num_nodes", "2", "--nproc_per_node", "1", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "t",
              "--rdzv_backend", backend)
    agents = []
    try:
        for rank in (1, 0):
            flags = (*common, "--node_rank", str(rank)) if backend == "static" else common
            agents.append((rank, start_agent(flags, (ROOT / "tests" / "workers" / "rank_env.py", "--out", out),
                                             tmp_path / f"node{rank}.log", tmp_path)))
        for rank, agent in agents:
            assert agent.wait(timeout=180) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    finally:
        for _, agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["CROSS_RANK"] == record["GROUP_RANK"] == record["RANK"] and record["CROSS_SIZE"] == "2", record
        assert not record["shadowed"] and record["path_head"][0] == str(ROOT / "tests" / "workers"), record


def test_a_node_rank_with_a_c10d_endpoint_is_refused_in_one_line(tmp_path, no_orphans):
    # c10d refuses a --node_rank it would ignore, in one line, before starting anything (a test of
    # its own: the refusal is the same whichever backend the test above ran).
    out = tmp_path / "out"
    refused = run_launcher("--num_nodes", "2", "--node_rank", "1", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
                           ROOT / "tests" / "workers" / "rank_env.py", "--out", out, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "launcher: error: --node_rank 1: the c10d rendezvous at --rdzv_endpoint numbers the nodes as they join, so "
        "it would be ignored; drop it, or add --rdzv_backend static to number the nodes by it (torchrun's default "
        "backend)"]
    assert not out.exists()  # no rank started


def test_a_node_that_never_comes_is_not_waited_for_for_ever(tmp_path, no_orphans):
    """Node 0 alone: torch elastic's rendezvous times out and the launcher says so, non-zero."""
    port = free_port()
    agent = start_agent(("--num_nodes", "2", "--node_rank", "0", "--nproc_per_node", "1", "--master_addr",
                         "127.0.0.1", "--master_port", str(port), "--rdzv_conf", "timeout=2"),
                        minimal_args("0", tmp_path / "l.json"), tmp_path / "node0.log", tmp_path)
    try:
        code = agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    output = (tmp_path / "node0.log").read_text()
    assert code != 0
    assert "rendezvous" in output.lower() and "Traceback" not in output, output[-2000:]


def test_gpt2_example_trains_as_two_simulated_nodes(tmp_path, no_orphans):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    config = read_config_file(GPT2 / "ds_config.json")
    config.pop("autotuning", None)
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, steps_per_print=2)
    config.pop("train_batch_size", None)
    config["zero_optimization"] = {"stage": 2}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    args = (GPT2 / "train.py", "--model_size", "tiny", "--max_steps", "6", "--seq_len", "64", "--corpus_mb", "0.5",
            "--deepspeed", ds)
    single = run_launcher("--nproc_per_node", "2", *args, "--output_dir", tmp_path / "one", cwd=tmp_path, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    # The two-node run reads the corpus the one-node run tokenized (the example caches it under
    # --output_dir): the same tokens, without training the tokenizer a second time.
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "cache").symlink_to(tmp_path / "one" / "cache", target_is_directory=True)
    node0, _ = run_two_nodes("static", (*args, "--output_dir", tmp_path / "two"), tmp_path)
    losses = re.compile(r"step (\d+)/6: loss ([\d.]+)")
    assert losses.findall(node0) == losses.findall(single.stdout) != []
    assert "2 ranks" in node0
    assert (tmp_path / "two" / "checkpoints" / "latest").exists()


# ----- a hostfile naming two hosts: the head starts one agent per host over ssh -----
@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    """`ssh` on PATH for the launcher: runs each remote command on this machine, logging the host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'workers' / 'fake_ssh.py'} \"$@\"\n")
    ssh.chmod(0o755)
    log = tmp_path / "ssh_hosts.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    return log


def two_host_file(tmp_path: Path) -> Path:
    # Two names for this machine: two "hosts" to the launcher, both reachable on loopback.
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    return path


def test_a_hostfile_of_two_hosts_starts_an_agent_on_each_over_ssh(tmp_path, fake_ssh, one_node_losses, no_orphans):
    # ZeRO 0, to compare with the static agents' one-node run (ZeRO 1 across two nodes is
    # test_slurm.py::test_two_nodes_of_an_allocation_train_as_one_node_with_two_ranks).
    expected = one_node_losses("0")
    two_nodes = tmp_path / "two_nodes.json"
    head = run_launcher("--hostfile", two_host_file(tmp_path), "--master_port", free_port(),
                        *minimal_args("0", two_nodes), cwd=tmp_path, timeout=240)
    assert head.returncode == 0, head.stderr[-3000:]
    # Each host was checked (`ssh HOST true`) before either was started.
    calls = fake_ssh.read_text().splitlines()
    assert sorted(calls[:2]) == ["127.0.0.1 check", "localhost check"]
    assert sorted(calls[2:]) == ["127.0.0.1 start", "localhost start"]
    assert "starting 2 nodes over ssh" in head.stderr
    got = json.loads(two_nodes.read_text())
    assert len(got) == 8 and len(set(got)) > 1
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_an_unreachable_host_is_refused_before_anything_starts(tmp_path, fake_ssh, no_orphans):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nunreachable-7 slots=1\n")
    head = run_launcher("--hostfile", hostfile, *toy_args(tmp_path), cwd=tmp_path)
    assert head.returncode == 2
    assert head.stderr.strip().splitlines() == [
        "launcher: error: --hostfile: not reachable over ssh without a password: unreachable-7 (ssh: Could not "
        "resolve hostname unreachable-7: Name or service not known); set up passwordless ssh to every host, or "
        "pass --no_ssh_check to skip this check"]
    assert not (tmp_path / "pids").exists()  # nothing started
    # Without the check the node's start fails, and the launcher says it was ssh's own failure.
    head = run_launcher("--hostfile", hostfile, "--no_ssh_check", "--master_port", free_port(),
                        *toy_args(tmp_path), cwd=tmp_path, timeout=120)
    assert head.returncode == 255 and "node 1 (unreachable-7) exited with status 255 (ssh's own failure" in head.stderr


def toy_args(tmp_path: Path, *extra: str) -> tuple:
    config = tmp_path / "toy.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 0}}))
    return (ROOT / "tests" / "workers" / "toy_train.py", "--pid_dir", tmp_path / "pids", *extra,
            "--deepspeed", config)


def test_a_failed_node_stops_the_others_and_nothing_is_left(tmp_path, fake_ssh, no_orphans):
    head = run_launcher("--hostfile", two_host_file(tmp_path), "--master_port", free_port(),
                        *toy_args(tmp_path, "--steps", "400", "--ms_per_step", "50", "--fail_rank", "1",
                                  "--fail_at_step", "3"), cwd=tmp_path, timeout=240)
    assert head.returncode == 1, head.stderr[-3000:]
    assert "injected failure on rank 1" in head.stderr
    # Whichever agent noticed first (the failed rank's, or its peer's when gloo lost the connection).
    assert re.search(r"node [01] \(\S+\) exited with status \d+; stopping the other nodes", head.stderr)
    assert_pids_dead(tmp_path / "pids", expected=2, grace_s=20)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_stopping_the_head_ends_every_node(how, tmp_path, fake_ssh, no_orphans):
    """Ctrl-C reaches the head alone (it runs in its own session here); even SIGKILL of the head
    ends every node, as their agents stop when the head's pipe closes."""
    head = subprocess.Popen([sys.executable, "-m", "autotuner", "--hostfile", str(two_host_file(tmp_path)),
                             "--master_port", str(free_port()),
                             *map(str, toy_args(tmp_path, "--steps", "2000", "--ms_per_step", "50"))],
                            cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: len(pids_in(tmp_path / "pids")) == 2, 120, "both nodes' ranks", head)
        head.send_signal(how)
        _, err = head.communicate(timeout=60)
        if how == signal.SIGINT:
            assert head.returncode == 130 and "stopped by SIGINT; stopping every node" in err
        assert_pids_dead(tmp_path / "pids", expected=2, grace_s=30)
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
