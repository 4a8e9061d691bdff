"""The launcher: script-argument rewriting, pure launch planning, the CLI's errors, and real
multi-process runs (a failing rank, Ctrl-C, SIGTERM, a bad config that must start no rank)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from autotuner.app.cli import main
from autotuner.core.errors import UsageError
from autotuner.launch import LaunchOptions, build_plan
from autotuner.launch.plan import DEFAULT_MASTER_PORT, LOOPBACK
from autotuner.launch.elastic import exit_status
from autotuner.launch.script_args import config_path, find_flag, replace_config, set_flag

from conftest import MINIMAL, ROOT, launcher_env, run_launcher

PYTHON = "/usr/bin/python-for-plan"

# --------------------------------------------------------------------------- script_args

AWKWARD = ("--name", "my run", "--quote", "it's \"quoted\"", "--cost=$HOME and $((1+1))", "--empty", "")


class TestScriptArgs:
    def test_find_flag_space_and_equals_forms(self):
        args = ("--steps", "5", "--lr=0.1", "--deepspeed", "ds.json")
        assert find_flag(args, "--steps") == (0, "5")
        assert find_flag(args, "--lr") == (2, "0.1")
        assert find_flag(args, "--deepspeed") == (3, "ds.json")

    def test_find_flag_absent_bare_and_prefix(self):
        assert find_flag(("--steps", "5"), "--missing") is None
        assert find_flag(("--verbose",), "--verbose") == (0, None)
        assert find_flag(("--verbose", "--steps", "5"), "--verbose") == (0, None)
        assert find_flag(("--steps5",), "--steps") is None  # a longer flag is not ours
        assert find_flag(("--lr", "-1"), "--lr") == (0, "-1")  # negative numbers are values

    def test_config_path_forms(self):
        assert config_path(("--deepspeed", "a.json")) == "a.json"
        assert config_path(("--deepspeed=a.json",)) == "a.json"
        assert config_path(("--deepspeed_config", "b.json")) == "b.json"
        assert config_path(("--deepspeed_config=b.json",)) == "b.json"
        assert config_path(("--deepspeed", "--deepspeed_config", "b.json")) == "b.json"  # DeepSpeed's form
        assert config_path(("--deepspeed",)) is None
        assert config_path(("--steps", "5")) is None

    def test_config_path_prefers_deepspeed_config(self):
        assert config_path(("--deepspeed", "a.json", "--deepspeed_config", "b.json")) == "b.json"

    def test_set_flag_space_form(self):
        assert set_flag(("--steps", "5", "x"), "--steps", "9") == ("--steps", "9", "x")

    def test_set_flag_equals_form(self):
        assert set_flag(("x", "--steps=5", "y"), "--steps", "9") == ("x", "--steps=9", "y")

    def test_set_flag_absent_is_appended(self):
        assert set_flag(("x",), "--steps", "9") == ("x", "--steps", "9")
        assert set_flag((), "--steps", "9") == ("--steps", "9")

    def test_set_flag_bare_gets_a_value(self):
        assert set_flag(("--bare", "--x", "1"), "--bare", "v") == ("--bare", "v", "--x", "1")
        assert set_flag(("--bare",), "--bare", "v") == ("--bare", "v")

    def test_replace_config_keeps_the_users_flag(self):
        assert replace_config(("--deepspeed", "a.json", "--steps", "3"), "new.json") == (
            "--deepspeed", "new.json", "--steps", "3")
        assert replace_config(("--deepspeed_config=a.json",), "new.json") == ("--deepspeed_config=new.json",)
        assert replace_config(("--deepspeed", "--deepspeed_config", "a.json"), "new.json") == (
            "--deepspeed", "--deepspeed_config", "new.json")

    def test_replace_config_without_config_is_a_usage_error(self):
        with pytest.raises(UsageError) as info:
            replace_config(("--deepspeed",), "new.json")
        assert info.value.exit_code == 2 and "--deepspeed PATH" in str(info.value)

    def test_awkward_arguments_pass_through_unchanged(self):
        args = (*AWKWARD, "--deepspeed", "dir with space/ds.json")
        assert config_path(args) == "dir with space/ds.json"
        assert find_flag(args, "--quote") == (2, "it's \"quoted\"")
        assert find_flag(args, "--cost") == (4, "$HOME and $((1+1))")
        rewritten = replace_config(args, "other dir/$x 'y'.json")
        assert rewritten == (*AWKWARD, "--deepspeed", "other dir/$x 'y'.json")
        assert set_flag(args, "--name", "a b") == ("--name", "a b", *args[2:])
        assert set_flag(args, "--new", "$1 \"2\"") == (*args, "--new", "$1 \"2\"")


# --------------------------------------------------------------------------- build_plan


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def plan_for(script: str, environ: dict | None = None, **options):
    return build_plan(LaunchOptions(script=script, **options), PYTHON, {} if environ is None else environ)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class TestBuildPlan:
    def test_default_nproc_on_cpu_is_1(self, script, monkeypatch):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        plan = plan_for(script)
        assert plan.nproc_per_node == 1 and plan.world_size == 1

    @pytest.mark.parametrize("nproc", [0, -1])
    def test_non_positive_nproc_is_a_usage_error(self, script, nproc):
        with pytest.raises(UsageError, match="--nproc_per_node") as info:
            plan_for(script, nproc_per_node=nproc)
        assert info.value.exit_code == 2

    def test_missing_script_is_a_usage_error(self, tmp_path):
        missing = str(tmp_path / "nope.py")
        with pytest.raises(UsageError, match="training script not found") as info:
            plan_for(missing)
        assert missing in str(info.value)

    def test_directory_as_script_is_a_usage_error(self, tmp_path):
        with pytest.raises(UsageError):
            plan_for(str(tmp_path))

    @pytest.mark.parametrize(
        "options, flag",
        [({"num_nodes": 0}, "--num_nodes"), ({"node_rank": 1}, "--node_rank"),
         ({"master_port": 70000}, "--master_port"), ({"master_port": 0}, "--master_port")],
    )
    def test_out_of_range_options_are_usage_errors(self, script, options, flag):
        with pytest.raises(UsageError, match=flag):
            plan_for(script, nproc_per_node=1, **options)

    def test_single_node_uses_c10d_on_loopback(self, script):
        plan = plan_for(script, nproc_per_node=2)
        assert plan.rdzv_backend == "c10d"
        assert plan.rdzv_endpoint == f"{LOOPBACK}:0"  # port 0: the OS picks a free one
        assert LOOPBACK == "127.0.0.1" and plan.local_addr == LOOPBACK
        assert plan.num_nodes == 1 and plan.world_size == 2 and plan.rdzv_configs == {}
        assert plan.run_id

    def test_single_node_with_master_port(self, script):
        plan = plan_for(script, nproc_per_node=1, master_port=29600)
        # Static: the store at --master_port is the ranks' MASTER_PORT, as with DeepSpeed's launcher.
        assert plan.rdzv_endpoint == "127.0.0.1:29600" and plan.rdzv_backend == "static"

    def test_two_nodes_without_master_addr_is_a_usage_error(self, script):
        with pytest.raises(UsageError, match="--master_addr"):
            plan_for(script, nproc_per_node=2, num_nodes=2)

    def test_two_nodes_use_static_rendezvous_with_rank(self, script):
        plan = plan_for(script, nproc_per_node=2, num_nodes=2, node_rank=1, master_addr="10.0.0.1")
        assert plan.rdzv_backend == "static"
        assert plan.rdzv_endpoint == f"10.0.0.1:{DEFAULT_MASTER_PORT}"
        assert plan.rdzv_configs == {"rank": 1}
        assert plan.world_size == 4 and plan.num_nodes == 2
        assert plan.local_addr is None  # not node 0: torch finds this host's address
        # Every node's agent names the same run, as torchrun does ("none"): the static store's keys
        # live under it, so two agents with their own ids would wait for each other for ever.
        assert plan.run_id == "none"
        assert plan_for(script, nproc_per_node=1, num_nodes=2, node_rank=0, master_addr="10.0.0.1").run_id == "none"

    def test_node_0_of_two_binds_the_master_addr(self, script):
        plan = plan_for(script, nproc_per_node=1, num_nodes=2, node_rank=0, master_addr="10.0.0.1",
                        master_port=1234)
        assert plan.rdzv_endpoint == "10.0.0.1:1234" and plan.rdzv_configs == {"rank": 0}
        assert plan.local_addr == "10.0.0.1"

    def test_rdzv_endpoint_uses_elastic_c10d(self, script):
        plan = plan_for(script, nproc_per_node=1, num_nodes=2, rdzv_endpoint="host:29400", rdzv_id="job7")
        assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.run_id) == ("c10d", "host:29400", "job7")

    def test_omp_threads_split_between_ranks(self, script):
        assert plan_for(script, nproc_per_node=1).env["OMP_NUM_THREADS"] == str(cores())
        assert plan_for(script, nproc_per_node=2).env["OMP_NUM_THREADS"] == str(max(1, cores() // 2))
        assert plan_for(script, nproc_per_node=10_000).env["OMP_NUM_THREADS"] == "1"

    def test_omp_threads_already_set_are_left_alone(self, script):
        assert "OMP_NUM_THREADS" not in plan_for(script, {"OMP_NUM_THREADS": "3"}, nproc_per_node=2).env

    def test_build_plan_does_not_touch_os_environ(self, script, monkeypatch):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        plan_for(script, nproc_per_node=2)
        assert "OMP_NUM_THREADS" not in os.environ

    def test_command_is_python_unbuffered_script_and_args(self, script):
        plan = plan_for(script, nproc_per_node=1, script_args=AWKWARD)
        # The deepspeed launcher's --local_rank=N goes right after the script; torch elastic fills it in.
        assert plan.command == (PYTHON, "-u", "-m", "autotuner.launch.run_script", script, "--local_rank=${local_rank}", *AWKWARD)


def test_exit_status_follows_the_shell_convention():
    assert exit_status(-9) == 137
    assert exit_status(-15) == 143
    assert exit_status(3) == 3
    assert exit_status(0) == 0


# --------------------------------------------------------------------------- CLI in-process


@pytest.fixture
def typo_config(tmp_path) -> Path:
    path = tmp_path / "typo_ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimisation": {"stage": 2}}')
    return path


class TestCli:
    def test_bad_config_is_one_error_line(self, script, typo_config, capsys):
        assert main(["--nproc_per_node", "2", script, "--deepspeed", str(typo_config)]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("launcher: error:")
        assert "typo_ds.json" in lines[0] and "zero_optimisation" in lines[0] and "zero_optimization" in lines[0]
        assert "Traceback" not in err and out == ""

    def test_bad_config_with_deepspeed_config_equals_form(self, script, typo_config, capsys):
        assert main([script, f"--deepspeed_config={typo_config}"]) == 2
        assert "zero_optimisation" in capsys.readouterr().err

    def test_missing_config_file(self, script, tmp_path, capsys):
        assert main([script, "--deepspeed", str(tmp_path / "none.json")]) == 2
        assert "none.json" in capsys.readouterr().err

    def test_debug_shows_the_traceback(self, script, typo_config, capsys):
        assert main(["--debug", script, "--deepspeed", str(typo_config)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "ConfigError" in err
        assert err.strip().splitlines()[-1].startswith("launcher: error:")

    @pytest.mark.parametrize(
        "argv, fragment",
        [
            (["--nproc_per_node", "0", "{script}"], "--nproc_per_node"),
            (["--nproc_per_node", "two", "{script}"], "invalid int value"),
            (["{missing}"], "training script not found"),
            (["--bogus", "{script}"], "unrecognized arguments: --bogus"),
            (["--autotuning", "sometimes", "{script}"], "--autotuning"),
            ([], "required"),
        ],
        ids=["nproc_0", "nproc_not_int", "missing_script", "unknown_flag", "bad_choice", "no_script"],
    )
    def test_usage_errors_exit_2_with_one_line(self, argv, fragment, script, tmp_path, capsys):
        argv = [a.format(script=script, missing=tmp_path / "missing.py") for a in argv]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("launcher: error:") and fragment in err and "Traceback" not in err


# --------------------------------------------------------------------------- real processes

RANK_FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(60)
"""

SLEEPER = """
import os, sys, time
from pathlib import Path
rank = os.environ["RANK"]
pid_file = Path(sys.argv[-1]) / f"rank{rank}.pid"  # after the launcher's --local_rank=N
pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
pid_file.with_suffix(".tmp").rename(pid_file)
print(f"ready {rank}", flush=True)
time.sleep(600)
"""


def write_script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def process_ended(pid: int, created: float) -> bool:
    """The process that had this pid (and start time) is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() != created or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_if_alive(pid: int, created: float) -> None:
    if not process_ended(pid, created):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_rank_status_is_the_launchers(tmp_path, no_orphans):
    script = write_script(tmp_path, "rank_fails.py", RANK_FAILS)
    result = run_launcher("--nproc_per_node", "2", script, timeout=90)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "rank 1 exited with status 3" in result.stderr
    assert "rank 1 failed first" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_ends_every_rank(tmp_path, no_orphans, sig, status):
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    ranks: dict[int, float] = {}  # pid -> create_time
    with open(out_path, "w") as out, open(err_path, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "autotuner", "--nproc_per_node", "2", str(script), str(pid_dir)],
            cwd=ROOT, env=launcher_env(), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
            start_new_session=True,  # our Ctrl-C goes to the launcher alone, as a terminal's would
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = sorted(pid_dir.glob("rank*.pid"))
            if len(files) == 2 and out_path.read_text().count("ready") == 2:
                break
            assert launcher.poll() is None, f"launcher exited early: {err_path.read_text()[-3000:]}"
            time.sleep(0.1)
        else:
            pytest.fail(f"ranks did not start: {err_path.read_text()[-3000:]}")
        for file in files:
            pid = int(file.read_text())
            ranks[pid] = psutil.Process(pid).create_time()

        launcher.send_signal(sig)
        returncode = launcher.wait(timeout=30)
        stderr = err_path.read_text()
        assert returncode == status, stderr[-3000:]
        assert f"stopped by {sig.name}" in stderr

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(process_ended(p, c) for p, c in ranks.items()):
            time.sleep(0.1)
        assert all(process_ended(p, c) for p, c in ranks.items()), f"ranks left running: {list(ranks)}"
    finally:
        if launcher.poll() is None:
            try:
                os.killpg(launcher.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid, created in ranks.items():
            kill_if_alive(pid, created)
        launcher.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_config_starts_no_rank(tmp_path, no_orphans):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2,
                                                                                         "overlap_com": True}}))
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", bad, "--steps", "2", timeout=90)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: error:"), result.stderr
    assert "bad.json" in lines[0] and "zero_optimization.overlap_com" in lines[0] and "overlap_comm" in lines[0]
    assert "step" not in result.stdout and "done" not in result.stdout
    assert "exited with status" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_master_port_is_the_ranks_master_port_on_one_node(tmp_path, no_orphans):
    import socket

    script = tmp_path / "echo_port.py"
    # One write per rank: print(a, b) writes its parts apart, and two ranks share the pipe.
    script.write_text("import os, sys\nsys.stdout.write(os.environ['RANK'] + ' ' + os.environ['MASTER_PORT'] + '\\n')\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_launcher("--nproc_per_node", "2", "--no_local_rank", "--master_port", port, script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.stdout.split()) == sorted(["0", str(port), "1", str(port)])


def test_the_launchers_config_check_builds_the_optimizer_without_importing_dynamo():
    """Checking the optimizer before anything launches must not import torch._dynamo (torch.optim's
    add_param_group wrapper does on its first call: 1.2 s of every launcher's start on 2 cores),
    must still refuse a bad param, and must leave torch's wrapper as it found it."""
    probe = textwrap.dedent("""
        import sys, torch
        from autotuner.config import load_config
        from autotuner.core.errors import ConfigError
        from autotuner.runtime.training.optim import check_optimizer_and_scheduler
        ok = load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
        check_optimizer_and_scheduler(ok, "ds.json")
        try:
            check_optimizer_and_scheduler(load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {
                "type": "AdamW", "params": {"lr": -1}}}), "ds.json")
            refused = False
        except ConfigError:
            refused = True
        wrapped = torch.optim.Optimizer.add_param_group.__wrapped__
        print("torch._dynamo" in sys.modules, refused, hasattr(wrapped, "__dynamo_disable"))
    """)
    out = subprocess.run([sys.executable, "-c", probe], env=launcher_env(), capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True", "False"]


@pytest.mark.slow
def test_a_script_that_does_not_declare_local_rank_is_told_of_no_local_rank(tmp_path, no_orphans):
    script = tmp_path / "strict.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    done = run_launcher("--nproc_per_node", "1", script)
    assert done.returncode == 2
    assert ("unrecognized arguments: --local_rank=0 (the launcher passes --local_rank=N to every rank, as DeepSpeed's "
            "does; a script that does not declare it needs the launcher's --no_local_rank)") in done.stderr
    assert run_launcher("--nproc_per_node", "1", "--no_local_rank", script).returncode == 0
