"""`--launcher slurm` on a real Slurm cluster: two slurmd (node1, node2) on this machine
(conftest's `slurm_cluster`). The launcher runs inside `salloc -N2`, reads the allocation's nodes
and starts one job step per node; the losses must equal one node's with two ranks, and a stop
(SIGTERM or Ctrl-C to the launcher, scancel of the job) must leave no process of the job."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from conftest import CONFIGS, MINIMAL, WORKERS, experiments_table, launcher_env, run_launcher
from fault_fuzz import draw_cases, journal_records
from process_checks import assert_pids_dead, pids_in, wait_for
from slurm_cluster import job_processes

pytestmark = [pytest.mark.timeout(600)]
slow = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_allocation(*launcher_args, nodes: int = 2) -> list[str]:
    """`salloc -N2 python -m autotuner ARGS`: the launcher as the allocation's command."""
    return ["salloc", f"--nodes={nodes}", "--job-name=autotuner-test", sys.executable, "-m", "autotuner",
            *map(str, launcher_args)]


def toy_args(tmp_path: Path, *extra: str) -> tuple:
    config = tmp_path / "toy.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 0}}))
    return (WORKERS / "toy_train.py", "--pid_dir", tmp_path / "pids", *extra, "--deepspeed", config)


def launcher_lines(stderr: str) -> list[str]:
    """The launcher's own lines (salloc and srun write theirs to the same stream)."""
    return [line for line in stderr.splitlines() if line.startswith("launcher:")]


def job_left(job_id: str, grace_s: float = 20.0) -> list:
    """Processes of the job still alive after `grace_s`: none when everything ended."""
    deadline = time.monotonic() + grace_s
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [(p.pid, " ".join(p.cmdline())[:100]) for p in left if p.is_running()]


def test_launcher_slurm_outside_an_allocation_is_refused_in_one_line(tmp_path):
    env = {key: value for key, value in launcher_env().items() if not key.startswith("SLURM_")}
    result = run_launcher("--launcher", "slurm", "--nproc_per_node", "1", *toy_args(tmp_path), cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launcher: error: --launcher slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run it inside "
        "salloc or sbatch, or use --launcher ssh with a --hostfile"]
    assert not (tmp_path / "pids").exists()


@slow
def test_two_nodes_of_an_allocation_train_as_one_node_with_two_ranks(slurm_cluster, tmp_path):
    args = (MINIMAL, "--deepspeed", CONFIGS / "zero1.json", "--steps", "8", "--losses_out")
    single = run_launcher("--nproc_per_node", "2", *args, tmp_path / "one_node.json", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]

    two = subprocess.run(in_allocation("--launcher", "slurm", "--nproc_per_node", "1", "--master_port",
                                       free_port(), *args, tmp_path / "two_nodes.json"),
                         cwd=tmp_path, env=slurm_cluster.env(launcher_env()), capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    # The nodes came from the allocation, and the rendezvous from node1's NodeAddr (its name does not resolve).
    assert ("launcher: starting 2 nodes over srun: node1 (node 0, 1 rank(s)), node2 (node 1, 1 rank(s)); "
            "rendezvous at 127.0.0.1:") in two.stderr
    expected = json.loads((tmp_path / "one_node.json").read_text())
    got = json.loads((tmp_path / "two_nodes.json").read_text())
    assert len(got) == 8 and len(set(got)) > 1
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert "Traceback" not in two.stderr


@slow
def test_more_nodes_than_the_allocation_holds_is_refused_in_one_line(slurm_cluster, tmp_path):
    result = subprocess.run(in_allocation("--launcher", "slurm", "--num_nodes", "3",
                                          "--nproc_per_node", "1", *toy_args(tmp_path)),
                            cwd=tmp_path, env=slurm_cluster.env(launcher_env()), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = launcher_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("launcher: error: --num_nodes: got 3, but the Slurm allocation "
                                                   "(job "), lines
    assert lines[0].endswith(") holds 2 host(s)")
    assert not (tmp_path / "pids").exists()


def start_training(cluster, tmp_path: Path) -> tuple[subprocess.Popen, psutil.Process, str]:
    """salloc running the launcher on both nodes, once both ranks run: (salloc, launcher, job id)."""
    salloc = subprocess.Popen(in_allocation("--launcher", "slurm", "--nproc_per_node", "1", "--master_port",
                                            free_port(), *toy_args(tmp_path, "--steps", "4000", "--ms_per_step", "50")),
                              cwd=tmp_path, env=cluster.env(launcher_env()), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(pids_in(tmp_path / "pids")) == 2, 120, "both nodes' ranks", salloc)
        launcher = next(p for p in psutil.Process(salloc.pid).children() if "autotuner" in p.cmdline())
        return salloc, launcher, launcher.environ()["SLURM_JOB_ID"]
    except BaseException:
        finish(salloc, timeout=0)
        raise


def finish(salloc: subprocess.Popen, timeout: float = 90) -> tuple[int, str]:
    """salloc's status and error output once it ends. Past `timeout` its session gets SIGTERM
    (salloc then cancels the job, and Slurm ends the steps), then SIGKILL."""
    try:
        _, err = salloc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(salloc.pid, signal.SIGTERM)
        try:
            _, err = salloc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(salloc.pid, signal.SIGKILL)
            _, err = salloc.communicate()
    return salloc.returncode, err


@slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda sig: sig.name)
def test_stopping_the_launcher_ends_every_step_and_rank(how, slurm_cluster, tmp_path):
    """The launcher (salloc's command) gets the signal: it stops every node's agent through its
    step's stdin and exits as torchrun does, 128 + the signal. Even a SIGKILLed launcher leaves
    nothing: the steps' stdin closes with it."""
    salloc, launcher, job_id = start_training(slurm_cluster, tmp_path)
    launcher.send_signal(how)
    code, err = finish(salloc)
    if how != signal.SIGKILL:
        assert code == 128 + how, err[-3000:]
        assert f"launcher: stopped by {how.name}; stopping every node" in err
    assert job_left(job_id) == []
    assert_pids_dead(tmp_path / "pids", expected=2, grace_s=10)
    assert "Traceback" not in err


@slow
def test_scancel_ends_every_step_rank_and_the_launcher(slurm_cluster, tmp_path):
    """scancel sends each step's processes SIGTERM (SIGKILL after KillWait): the agents end their
    ranks, and the launcher, seeing its nodes end, ends too with the first node's status."""
    salloc, launcher, job_id = start_training(slurm_cluster, tmp_path)
    cancelled = slurm_cluster.command("scancel", job_id)
    code, err = finish(salloc)
    assert cancelled.returncode == 0, cancelled.stderr
    assert code != 0, err[-3000:]
    assert "exited with status" in err and "stopping the other nodes" in err, err[-3000:]
    assert job_left(job_id) == []
    assert_pids_dead(tmp_path / "pids", expected=2, grace_s=10)
    assert not launcher.is_running() or launcher.status() == psutil.STATUS_ZOMBIE


@slow
def test_scancel_of_a_batch_job_ends_everything_within_the_ranks_grace(slurm_cluster, tmp_path):
    """Under sbatch the launcher runs in the batch step: scancel signals it, each srun and each
    node's processes at once. Each agent stops once (its stdin closing as srun goes is no second
    stop, which would cut the ranks' grace short), and nothing of the job is left."""
    launcher = [sys.executable, "-m", "autotuner", "--launcher", "slurm", "--nproc_per_node", "1", "--master_port",
                str(free_port()), *map(str, toy_args(tmp_path, "--steps", "4000", "--ms_per_step", "50"))]
    output = tmp_path / "job.out"
    submitted = slurm_cluster.command("sbatch", "--nodes=2", f"--chdir={tmp_path}", f"--output={output}",
                                      "--job-name=autotuner-test", "--parsable", "--wrap", shlex.join(launcher))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: len(pids_in(tmp_path / "pids")) == 2, 120, "both nodes' ranks")
    finally:
        cancelled = slurm_cluster.command("scancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert job_left(job_id) == []
    assert_pids_dead(tmp_path / "pids", expected=2, grace_s=10)
    wait_for(lambda: not slurm_cluster.command("squeue", "-h", "-j", job_id).stdout.strip(), 60, "the job's end")
    lines = launcher_lines(output.read_text())
    assert "launcher: stopped by SIGTERM; stopping every node" in lines, lines
    assert lines.count("launcher: stopped by SIGTERM; all ranks ended") == 2, lines
    assert not any("again" in line for line in lines), lines


# ----- autotuning inside an allocation (--backend slurm) -----

def tune_in_allocation(cluster, tmp_path: Path, mode: str = "tune", *extra: str, nodes: int = 2, warm: bool = False):
    from conftest import write_config

    config = write_config(tmp_path / "ds.json", {"max_train_micro_batch_size_per_gpu": 8, "tuner_type": "predictive",
                                                 "warm_start": warm})
    return subprocess.run(in_allocation("--autotuning", mode, "--backend", "slurm", "--num_nodes", "1",
                                        "--nproc_per_node", "1", *extra, WORKERS / "toy_train.py", "--ms_per_step",
                                        # 8 steps: an experiment's window needs 5; the training runs (the
                                        # tuner's and the sbatch script's) take the rest.
                                        "300", "--steps", "8", "--deepspeed", config, nodes=nodes),
                          cwd=tmp_path, env=cluster.env(launcher_env()), capture_output=True, text=True, timeout=500)


def _interval(exp_dir: Path) -> tuple[float, float]:
    """When an experiment started (its command written) and when its window was measured."""
    return (exp_dir / "cmd.txt").stat().st_mtime, (exp_dir / "metrics.json").stat().st_mtime


@slow
def test_a_tune_runs_experiments_on_both_nodes_two_at_once_then_trains_with_the_pick(slurm_cluster, tmp_path):
    result = tune_in_allocation(slurm_cluster, tmp_path, "run", warm=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "slurm: job " in result.stdout and "1 per experiment, up to 2 at once" in result.stdout
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[table.state == "ok"]
    assert set(ok.hosts) == {"node1", "node2"}, table[["name", "state", "hosts"]]
    # Warm on both nodes: each node's server preloaded once, and every rank was forked from it.
    assert "slurm: warm launches: a preloaded server on each node" in result.stdout
    for host in ("node1", "node2"):
        assert result.stdout.count(f"slurm: {host}: warm start: forkserver preloaded") == 1, result.stdout
    assert all((tmp_path / "autotuning_exps" / name / "warm_ranks.txt").exists() for name in ok.name)
    assert "ended (srun status" not in result.stdout
    # Two experiments on different nodes overlapped in time.
    spans = {name: _interval(tmp_path / "autotuning_exps" / name) for name in ok.name}
    hosts = dict(zip(ok.name, ok.hosts))
    assert any(hosts[a] != hosts[b] and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
               for a in spans for b in spans if a < b), (spans, hosts)
    # The sbatch script beside the optimal command, and the training run across the allocation.
    script = (tmp_path / "autotuning_results" / "sbatch_optimal.sh").read_text()
    assert "#SBATCH --nodes=1" in script and script.count("--launcher slurm --num_nodes 1") == 1
    # cmd_optimal.txt too trains on the allocation's nodes (under salloc the tuner may run on a
    # login node), as many per run as each experiment had.
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert " --launcher slurm --num_nodes 1 --nproc_per_node " in command, command
    assert "ds_config_optimal.json" in script
    assert "training with the optimal config" in result.stdout
    assert "launcher: starting 1 nodes over srun: node1" in result.stderr
    assert "Traceback" not in result.stderr
    # The script is ready to submit: as a batch job it trains with the pick.
    output = tmp_path / "optimal.out"
    submitted = slurm_cluster.command("sbatch", "--parsable", f"--output={output}", f"--chdir={tmp_path}",
                                      str(tmp_path / "autotuning_results" / "sbatch_optimal.sh"))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    wait_for(lambda: not slurm_cluster.command("squeue", "-h", "-j", job_id).stdout.strip(), 180, "the batch job")
    text = output.read_text()
    assert "launcher: starting 1 nodes over srun" in text and "error" not in text.lower(), text[-3000:]
    shown = slurm_cluster.command("scontrol", "show", "job", "-o", job_id)  # kept MinJobAge (300 s) after its end
    assert shown.returncode != 0 or "ExitCode=0:0" in shown.stdout, shown.stdout
    assert job_left(job_id) == []


@slow
def test_backend_slurm_outside_an_allocation_is_refused_in_one_line(tmp_path):
    from conftest import write_config

    env = {key: value for key, value in launcher_env().items() if not key.startswith("SLURM_")}
    config = write_config(tmp_path / "ds.json")
    result = run_launcher("--autotuning", "tune", "--backend", "slurm", "--nproc_per_node", "1",
                          WORKERS / "toy_train.py", "--deepspeed", config, cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("launcher: error: --backend slurm: not inside a Slurm "
                                                             "allocation"), result.stderr
    assert not (tmp_path / "autotuning_exps").exists()


# A slow experiment's step: its four steps (about 4 s) leave a fault test's fault room to land
# mid-experiment (it comes within a second of the experiment's start), and its relaunch is short.
SLOW_MS_PER_STEP = 1000


def start_tune(cluster, tmp_path: Path, *salloc_flags: str, warm: bool = False,
               ms_per_step: int = SLOW_MS_PER_STEP, slow_only_at: int | None = None) -> subprocess.Popen:
    """A slow tune (1 s a step by default) as salloc's command, its output to files. With
    `slow_only_at`, only that micro-batch's experiment is slow (the one a fault test cuts short);
    the others step every 0.3 s."""
    from conftest import write_config

    config = write_config(tmp_path / "ds.json", {"max_train_micro_batch_size_per_gpu": 16, "tuner_type": "predictive",
                                                 "warm_start": warm})
    pace = (["--ms_per_step", str(ms_per_step)] if slow_only_at is None else
            ["--ms_per_step", "300", "--ms_per_step_at", f"{slow_only_at}:{ms_per_step}"])
    command = ["salloc", *salloc_flags, "--nodes=2", "--job-name=autotuner-test", sys.executable, "-m", "autotuner",
               "--autotuning", "tune", "--backend", "slurm", "--num_nodes", "1", "--nproc_per_node", "1",
               str(WORKERS / "toy_train.py"), *pace, "--steps", "12", "--deepspeed", str(config)]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        return subprocess.Popen(command, cwd=tmp_path, env=cluster.env(launcher_env()), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True)


@contextmanager
def tune_in_background(cluster, tmp_path: Path, *salloc_flags: str, warm: bool = False,
                       ms_per_step: int = SLOW_MS_PER_STEP,
                       slow_only_at: int | None = None):
    """`start_tune`'s salloc, killed with its session on the way out if it is still running."""
    tuner = start_tune(cluster, tmp_path, *salloc_flags, warm=warm, ms_per_step=ms_per_step,
                       slow_only_at=slow_only_at)
    try:
        yield tuner
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
            tuner.wait()


def job_of(tmp_path: Path) -> str:
    import re

    wait_for(lambda: "slurm: job " in (tmp_path / "out.txt").read_text(), 60, "the tune's start")
    return re.search(r"slurm: job (\d+)", (tmp_path / "out.txt").read_text()).group(1)


@slow
def test_scancel_mid_tune_keeps_the_finished_records_and_a_new_allocation_resumes(slurm_cluster, tmp_path):
    # Cancelled while the second profile launch (micro-batch 8, slow) runs.
    with tune_in_background(slurm_cluster, tmp_path, warm=True, slow_only_at=8) as tuner:  # its servers and ranks end too
        job_id = job_of(tmp_path)
        wait_for(lambda: (tmp_path / "autotuning_exps" / "z0_gas1_mbs1" / "exp.json").exists(), 120,
                 "the first record", tuner)
        assert slurm_cluster.command("scancel", job_id).returncode == 0
        status = tuner.wait(timeout=120)
    err = (tmp_path / "err.txt").read_text()
    assert status == 143, err[-3000:]
    assert (f"autotuner: stopped by the end of Slurm job {job_id} (CANCELLED); running experiment ended, finished "
            "records kept in autotuning_exps. Resume with the same command in a new allocation.") in err
    assert job_left(job_id) == []
    kept = sorted(p.parent.name for p in (tmp_path / "autotuning_exps").glob("*/exp.json"))
    assert "z0_gas1_mbs1" in kept
    # Nothing the cancellation cut short was recorded: every record kept is a measured one.
    assert all(json.loads((tmp_path / "autotuning_exps" / n / "exp.json").read_text())["result"]["state"] == "ok"
               for n in kept), kept
    # Records carry the allocation's nodes as their device (not the tuner host's): a resume on
    # nodes of other hardware would not reuse them, a new allocation of these nodes does (below).
    device = json.loads((tmp_path / "autotuning_exps" / "z0_gas1_mbs1" / "exp.json").read_text())["fingerprint"]["device"]
    assert device.startswith("slurm nodes: 2x Arch=") and "CPUTot=" in device, device
    first = (tmp_path / "autotuning_exps" / "z0_gas1_mbs1" / "cmd.txt").stat().st_mtime

    resumed = start_tune(slurm_cluster, tmp_path, warm=True, slow_only_at=8)
    assert resumed.wait(timeout=400) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    out = (tmp_path / "out.txt").read_text()
    assert "z0_gas1_mbs1: ok (from an earlier run)" in out
    assert (tmp_path / "autotuning_exps" / "z0_gas1_mbs1" / "cmd.txt").stat().st_mtime == first  # not launched again
    assert (tmp_path / "autotuning_results" / "ds_config_optimal.json").exists()


@slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_node_lost_mid_tune_is_left_out_and_its_experiment_runs_again_on_the_nodes_left(warm, slurm_cluster,
                                                                                         tmp_path):

    try:
        # --no-kill: the job outlives a node's failure
        with tune_in_background(slurm_cluster, tmp_path, "--no-kill", warm=warm, slow_only_at=8) as tuner:
            job_of(tmp_path)
            wait_for(lambda: (tmp_path / "autotuning_exps" / "z0_gas1_mbs8" / "cmd.txt").exists(), 120,
                     "the second profile launch", tuner)
            host = (tmp_path / "autotuning_exps" / "z0_gas1_mbs8" / "hostfile").read_text().split()[0]
            down = slurm_cluster.command("scontrol", "update", f"nodename={host}", "state=down", "reason=test")
            assert down.returncode == 0, down.stderr
            status = tuner.wait(timeout=400)
    finally:
        slurm_cluster.command("scontrol", "update", "nodename=node1,node2", "state=resume")
        wait_for(lambda: slurm_cluster.command("sinfo", "-h", "-o", "%t").stdout.split() == ["idle"], 60,
                 "both nodes idle again")
    out = (tmp_path / "out.txt").read_text()
    assert status == 0, out[-2000:] + (tmp_path / "err.txt").read_text()[-2000:]
    assert f"slurm: z0_gas1_mbs8 failed on node(s) {host}, which the job lost; launched again on the nodes left" in out
    table = experiments_table(tmp_path / "autotuning_results")
    other = ({"node1", "node2"} - {host}).pop()
    later = table[table.name != "z0_gas1_mbs1"]
    assert (table.state == "ok").all(), table[["name", "state", "hosts", "error"]]
    assert set(later.hosts) == {other}, table[["name", "hosts"]]
    assert job_left(job_of(tmp_path)) == []
    if warm:  # the lost node's server ended with its step; the other node's stayed warm
        assert f"slurm: the warm server on {host} ended" in out
        assert f"slurm: {other}: warm start: forkserver preloaded" in out


@slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=lambda sig: sig.name)
def test_stopping_a_warm_tune_ends_each_nodes_server_and_its_ranks(how, slurm_cluster, tmp_path):
    """The tuner (salloc's command) gets the signal while each node's server runs an experiment:
    closing the servers' stdin ends their ranks (SIGINT); at the tuner's death (SIGKILL) salloc
    releases the job and Slurm ends its steps. Nothing of the job is left either way."""
    # Only the second profile launch (micro-batch 8) is slow: node2's server starts with it, and it
    # is still running when the signal comes; the first launch, on node1, is over quickly.
    with tune_in_background(slurm_cluster, tmp_path, warm=True, slow_only_at=8) as tuner:
        job_id = job_of(tmp_path)
        out = tmp_path / "out.txt"
        wait_for(lambda: all(f"slurm: {host}: warm start: forkserver preloaded" in out.read_text()
                             for host in ("node1", "node2")), 120, "both nodes' servers", tuner)
        head = next(p for p in psutil.Process(tuner.pid).children() if "autotuner" in p.cmdline())
        head.send_signal(how)
        status = tuner.wait(timeout=120)
    err = (tmp_path / "err.txt").read_text()
    if how == signal.SIGINT:
        assert status == 130, err[-3000:]
        assert "autotuner: stopped by SIGINT; running experiment ended" in err
        assert "Traceback" not in err
    assert job_left(job_id) == []


@slow
def test_a_warm_server_that_dies_mid_experiment_is_replaced_by_a_cold_launch_on_the_same_node(slurm_cluster, tmp_path):
    """The server is killed, not the node: the experiment it ran is launched again, cold, and is
    measured; the tune goes on, and nothing of the job is left."""

    with tune_in_background(slurm_cluster, tmp_path, warm=True, slow_only_at=8) as tuner:
        job_id = job_of(tmp_path)
        trial = tmp_path / "autotuning_exps" / "z0_gas1_mbs8"
        wait_for(lambda: (trial / "warm_ranks.txt").exists(), 120, "the second profile launch's ranks", tuner)
        host = (trial / "hostfile").read_text().split()[0]
        servers = [p for p in job_processes(job_id) if "autotuner.execution.node_server" in " ".join(p.cmdline())
                   and p.environ().get("SLURMD_NODENAME") == host]
        assert len(servers) == 1, servers
        servers[0].kill()
        status = tuner.wait(timeout=400)
    out = (tmp_path / "out.txt").read_text()
    assert status == 0, out[-2000:] + (tmp_path / "err.txt").read_text()[-2000:]
    assert f"slurm: the warm server on {host} ended" in out
    assert f"slurm: z0_gas1_mbs8 was cut short by the end of {host}'s warm server; launched again, cold" in out
    table = experiments_table(tmp_path / "autotuning_results").set_index("name")
    assert table.loc["z0_gas1_mbs8", "state"] == "ok", table[["state", "error"]]
    assert job_left(job_id) == []


@slow
def test_hugging_faces_run_clm_is_tuned_warm_on_both_nodes_then_trained_across_the_allocation(slurm_cluster, tmp_path):
    """A third party's script, unchanged: run_clm.py on DeepSpeed's engine, Hugging Face's ZeRO-2
    config with its "auto"s, each experiment on one node's warm server, then `run` trains the pick."""
    from hf_configs import HF_AUTO, MISSING, RUN_CLM, TEST_SIZED, hf_env, run_clm_args, write_tiny_gpt2

    if MISSING or not RUN_CLM.is_file():
        pytest.skip(f"needs run_clm.py and {', '.join(MISSING) or 'its libraries'}")
    (tmp_path / "tiny_gpt2").mkdir()
    model = write_tiny_gpt2(tmp_path / "tiny_gpt2")
    # Micro-batches up to 2: the profile launch's 1 on one node's server, 2 on the other's.
    (tmp_path / "ds.json").write_text(json.dumps({**HF_AUTO, "autotuning": {**HF_AUTO["autotuning"], **TEST_SIZED,
                                                                            "max_train_micro_batch_size_per_gpu": 2}}))
    result = subprocess.run(in_allocation("--autotuning", "run", "--backend", "slurm", "--num_nodes", "1",
                                          "--nproc_per_node", "1", *run_clm_args(model, tmp_path / "out"),
                                          "--deepspeed", tmp_path / "ds.json"),
                            cwd=tmp_path, env=slurm_cluster.env(hf_env(tmp_path)), capture_output=True, text=True,
                            timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for host in ("node1", "node2"):
        assert f"slurm: {host}: warm start: forkserver preloaded" in result.stdout, result.stdout[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[table.state == "ok"]
    assert len(ok) >= 2 and set(ok.hosts) == {"node1", "node2"}, table[["name", "state", "hosts", "error"]]
    assert all((tmp_path / "autotuning_exps" / name / "warm_ranks.txt").exists() for name in ok.name)
    assert "training with the optimal config" in result.stdout
    assert (tmp_path / "out" / "train_results.json").exists(), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


SLURM_FUZZ_SEED = int(os.environ.get("AUTOTUNER_FAULT_FUZZ_SEED") or random.SystemRandom().randrange(1, 10**6))
SLURM_FAULTS = ("SIGINT", "SIGTERM", "SIGKILL", "scancel")
FUZZ_MS_PER_STEP = 300
SLURM_TUNE_LENGTH_S = 13.0  # the fuzz tune's clean length from the job's start (12.5 s measured here)
# One case a run (each costs about 30 s): its fault is the first of the four shuffled by the seed,
# which differs every run, so every fault kind is drawn over runs (and any one replays by its seed).
SLURM_CASES = draw_cases(SLURM_FUZZ_SEED, 1, {"slurm_warm": SLURM_TUNE_LENGTH_S}, ("slurm_warm",), SLURM_FAULTS)
# salloc's exit status once the fault landed: its command's, and 0 for a command killed by
# SIGKILL (Slurm 22.05's salloc reports it so; measured here).
FUZZ_STATUS = {"SIGINT": {130}, "SIGTERM": {143}, "scancel": {143}, "SIGKILL": {0, 137}}


@slow
@pytest.mark.parametrize("case", SLURM_CASES, ids=[f"seed{SLURM_FUZZ_SEED}-case{c.index}-{c.fault}-{c.delay_s:.1f}s"
                                                   for c in SLURM_CASES])
def test_a_warm_tune_stopped_at_a_random_instant_leaves_nothing_of_the_job_and_resumes(slurm_cluster, tmp_path, case):
    """Replays with AUTOTUNER_FAULT_FUZZ_SEED=S (the seed is in the test id). The instant is drawn
    over the tune's clean length from the job's start: the nodes' servers starting, experiments
    running on both nodes, results coming back, the summary being written."""
    with tune_in_background(slurm_cluster, tmp_path, warm=True, ms_per_step=FUZZ_MS_PER_STEP) as tuner:
        job_id = job_of(tmp_path)
        time.sleep(case.delay_s)
        landed = tuner.poll() is None
        if landed and case.fault == "scancel":
            slurm_cluster.command("scancel", job_id)
        elif landed:
            head = [p for p in psutil.Process(tuner.pid).children() if "autotuner" in p.cmdline()]
            landed = bool(head)
            if landed:
                head[0].send_signal(getattr(signal, case.fault))
        status = tuner.wait(timeout=120)
    err = (tmp_path / "err.txt").read_text()
    what = f"{case.describe(SLURM_FUZZ_SEED)}: "
    assert status in (FUZZ_STATUS[case.fault] | {0} if landed else {0}), what + f"exit {status}: {err[-3000:]}"
    if status != 0 and case.fault != "SIGKILL":
        assert "Traceback" not in err, what + err[-3000:]
    assert job_left(job_id) == [], what
    complete, problems = journal_records(tmp_path)
    assert problems == [], what + str(problems)

    launched = {name: (tmp_path / "autotuning_exps" / name / "cmd.txt").stat().st_mtime for name in complete}

    resumed = start_tune(slurm_cluster, tmp_path, warm=True, ms_per_step=FUZZ_MS_PER_STEP)
    assert resumed.wait(timeout=400) == 0, what + (tmp_path / "err.txt").read_text()[-3000:]
    again = [name for name, mtime in launched.items()
             if (tmp_path / "autotuning_exps" / name / "cmd.txt").stat().st_mtime != mtime]
    assert again == [], what + f"complete records launched again on resume: {again}"
    assert (tmp_path / "autotuning_results" / "ds_config_optimal.json").exists()
