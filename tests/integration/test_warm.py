"""Warm launches on 2 CPU ranks: the same verdicts and figures as cold ones, and a logged fall back
to cold when the warm path cannot serve (issue 13). The fault suite (test_faults.py) runs on the
warm path too, since warm is the default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import build_plan, rank_launch
from autotuner.launch.warm_rank import script_argv
from autotuner.core.script_imports import script_imports
from conftest import WORKERS, experiments_table, launcher_env, tune, write_config

WARM_TUNING = {"model_info": {"num_params": 1000}}


def table(tmp_path: Path) -> pd.DataFrame:
    table = experiments_table(tmp_path / "autotuning_results")
    return table[table.phase != "remeasure"].reset_index(drop=True)  # one row per experiment


# ----- pure pieces -----

def test_script_imports_are_read_from_the_source_and_its_own_modules_which_are_not_preloaded(tmp_path):
    (tmp_path / "helper.py").write_text("def load():\n    import psutil\n")
    script = tmp_path / "train.py"
    script.write_text("from __future__ import annotations\nimport os, json\nimport torch.nn as nn\n"
                      "from torch.utils.data import DataLoader\nfrom . import sibling\nimport helper\n"
                      "try:\n    import pandas\nexcept ImportError:\n    pandas = None\n"
                      "def main():\n    import tabulate\n    import not_installed_anywhere\n")
    assert sorted(script_imports(str(script))) == sorted([
        "os", "json", "torch.nn", "torch.utils.data", "torch.utils.data:DataLoader", "pandas", "tabulate", "psutil"])


def test_a_folder_on_the_tuners_path_named_like_a_scripts_module_is_not_preloaded(tmp_path, monkeypatch):
    # A `data/` folder in the working directory and the script's own data.py in a folder it puts on
    # sys.path itself: preloaded, the folder (an empty namespace package) shadowed data.py in every
    # warm rank ("cannot import name 'TokenBlocks' from 'data' (unknown location)").
    (tmp_path / "work" / "data").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "work"))
    (tmp_path / "code" / "lib").mkdir(parents=True)
    (tmp_path / "code" / "lib" / "data.py").write_text("ANSWER = 42\n")
    script = tmp_path / "code" / "train.py"
    script.write_text("import sys\nsys.path.insert(0, 'lib')\nfrom data import ANSWER\nimport json\n")
    assert script_imports(str(script)) == ["sys", "json"]


def test_a_warm_rank_gets_the_cold_ranks_command_and_elastics_variables(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    plan = build_plan(LaunchOptions(script=str(script), script_args=("--deepspeed", "ds.json"), nproc_per_node=2,
                                    report_file=str(tmp_path / "r.json")), "/usr/bin/python3", {})
    command, env = rank_launch(plan, 1, "127.0.0.1", 4321, {"PATH": "/bin"})
    assert command == ("/usr/bin/python3", "-u", "-m", "autotuner.launch.run_script", str(script), "--local_rank=1",
                       "--deepspeed", "ds.json")
    assert script_argv(command) == ([], [str(script), "--local_rank=1", "--deepspeed", "ds.json"])
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "PATH")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4321", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "PATH": "/bin"}
    assert env["LOCAL_SIZE"] == "2" and env["OMP_NUM_THREADS"]


def test_the_tuner_process_does_not_run_the_forkserver_preload():
    """Importing warm_preload preloads (torch.distributed.fsdp, dynamo: over a second); only the
    forkserver may import it, never the tuner that starts it."""
    probe = ("import sys, autotuner.app.tune; "
             "print('autotuner.launch.warm_preload' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=launcher_env(), capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_rank_entry_prefix_is_split_from_the_script(tmp_path):
    command = ("py", "-m", "autotuner.launch.rank_entry", "--core_groups", "0;1", "--", "py", "-u", "-m",
               "autotuner.launch.run_script", "t.py", "--a")
    assert script_argv(command) == (["--core_groups", "0;1"], ["t.py", "--a"])


# ----- real launches -----

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_warm_and_cold_give_the_same_verdicts_and_figures(tmp_path, no_orphans):
    """Both paths, one after the other on the same experiments: the same states, throughputs
    within noise (a fixed per-sample sleep dominates the step, so the figure is known), and the
    interpreter's default multiprocessing start method (a forkserver's child inherits "forkserver",
    which made a DeepSpeed script's DataLoader workers cost seconds per warm launch)."""
    results, start_methods = {}, {}
    for warm in (True, False):
        work = tmp_path / ("warm" if warm else "cold")
        work.mkdir()
        config = write_config(work / "ds.json", {**WARM_TUNING, "warm_start": warm}, train_micro_batch_size_per_gpu=[2, 4])
        methods = work / "start_methods.txt"
        result = tune(work, config, "--ms_per_sample", "20", "--fault_at_micro", "4:fail", "--fail_rank", "1",
                      "--echo_start_method_to", str(methods))
        start_methods[warm] = methods.read_text().split()
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert ("warm start off (autotuning.warm_start: false)" in result.stdout) is (not warm)
        assert (work / "autotuning_exps" / "z0_gas1_mbs2" / "warm_ranks.txt").exists() is warm
        results[warm] = table(work).set_index("name")
    warm, cold = results[True], results[False]
    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert start_methods[True] == start_methods[False] == [fresh] * 2
    assert list(warm.state) == list(cold.state) == ["ok", "failed"]
    assert warm.loc["z0_gas1_mbs4", "error"] == cold.loc["z0_gas1_mbs4", "error"] == \
        "rank 1: RuntimeError: injected failure on rank 1 at step 2"
    # 2 samples x 20 ms of sleep per rank and step (4 samples per step): about 100 samples/s either way;
    # at 5 ms a 10 ms step was within reach of one scheduling hiccup over the 3 timed steps.
    assert warm.loc["z0_gas1_mbs2", "metric_value"] == pytest.approx(cold.loc["z0_gas1_mbs2", "metric_value"],
                                                                     rel=0.25)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_crashes_only_when_warm_falls_back_to_cold_with_a_log_line(tmp_path, no_orphans):
    result = tune(tmp_path, write_config(tmp_path / "ds.json", WARM_TUNING, train_micro_batch_size_per_gpu=[2, 4]),
                  "--segfault_if_forked")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("warm start off: z0_gas1_mbs2 failed warm (rank 1: exit status 139 (killed by SIGSEGV)) but not cold; "
            "every launch from now on starts cold") in result.stdout
    assert list(table(tmp_path).state) == ["ok", "ok"]
    assert not (tmp_path / "autotuning_exps" / "z0_gas1_mbs4" / "warm_ranks.txt").exists()


def tune_preloading(tmp_path: Path, module: str, tmpdir: Path | None = None,
                    sizes: tuple[int, ...] = (2, 4)) -> subprocess.CompletedProcess:
    """Tune with one of tests/workers/preload_faults/ in autotuning.warm_preload."""
    env = launcher_env()
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS / "preload_faults"), env["PYTHONPATH"]])
    return tune(tmp_path, write_config(tmp_path / "ds.json", {**WARM_TUNING, "warm_preload": [module]},
                                     train_micro_batch_size_per_gpu=list(sizes)), env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_preload_that_raises_is_reported_and_warm_launches_go_on(tmp_path, no_orphans):
    """Under a TMPDIR too long for a socket's path too (a CI job's): the forkserver's socket then
    goes to a short directory, as Python 3.13's multiprocessing does, and warm start keeps working."""
    long_tmpdir = tmp_path / ("t" * max(1, 80 - len(str(tmp_path))))
    long_tmpdir.mkdir()
    assert len(str(long_tmpdir)) >= 80  # with autotuner-mp-PID-XXXXXXXX/listener-XXXXXXXX: over 107
    result = tune_preloading(tmp_path, "raises_at_import", tmpdir=long_tmpdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("warm start: could not preload raises_at_import (ImportError: this module refuses to be imported); "
            "ranks import it themselves") in result.stdout
    assert "warm start off" not in result.stdout
    assert not [p for p in long_tmpdir.iterdir() if p.name.startswith("autotuner-")]  # torch's caches may stay
    assert list(table(tmp_path).state) == ["ok", "ok"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forkserver_that_dies_while_preloading_falls_back_to_cold(tmp_path, no_orphans):
    # One experiment: it runs cold (about 9 s where a warm one takes 1); that every later launch
    # stays cold is test_a_rank_that_crashes_only_when_warm_falls_back_to_cold_with_a_log_line's.
    result = tune_preloading(tmp_path, "exits_at_import", sizes=(2,))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "warm start off: the forkserver exited while preloading; every launch from now on starts cold" \
        in result.stdout
    assert list(table(tmp_path).state) == ["ok"]
    assert not (tmp_path / "autotuning_exps" / "z0_gas1_mbs2" / "warm_ranks.txt").exists()  # it ran cold


def test_closing_the_runner_ends_a_rank_the_forkserver_forked_but_the_runner_never_heard_of(no_orphans):
    """Ctrl-C during `start_processes` left such ranks retrying the tuner's closed store, and the
    forkserver, which exits only when every holder of its pipe has, was waited for without a bound."""
    result = subprocess.run([sys.executable, str(WORKERS / "warm_stop_with_an_untracked_rank.py"),
                             str(WORKERS / "toy_train.py")], env=launcher_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["closed_in_s"] < 15 and not outcome["rank_alive"] and not outcome["forkserver_alive"]


def test_the_forkserver_starts_before_the_launcher_imports_torch_and_a_later_config_error_ends_it(tmp_path):
    """The early start (both torch imports side by side), and a config error that `settle` finds
    after it: exit 2 in one line, the forkserver ended and its directories removed."""
    config = write_config(tmp_path / "ds.json", {"mp_size": 3},  # loads, but cannot divide 2 ranks
                          zero_optimization={"stage": 0, "sub_group_size": 1e9})  # DeepSpeed's: one warning
    launcher = subprocess.Popen([sys.executable, "-m", "autotuner", "--debug", "--autotuning", "tune",
                                 "--nproc_per_node", "2", str(WORKERS / "toy_train.py"), "--deepspeed", str(config)],
                                cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 2, stdout + stderr
    started = [line for line in stderr.splitlines() if "warm start: forkserver" in line]
    assert len(started) == 1 and started[0].endswith("started early (torch imported here already: False)"), stderr
    server_pid = int(started[0].split("forkserver ")[1].split()[0])
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert "launcher: error: " in stderr and "autotuning.mp_size: got 3" in stderr
    assert stderr.count("accepted but not used by autotuner: zero_optimization.sub_group_size") == 1, stderr
    left = [path for root in {tempfile.gettempdir(), "/tmp"} for path in Path(root).glob(f"autotuner-*-{launcher.pid}-*")]
    assert not left, left


def children_of(pid: int) -> list[tuple[psutil.Process, str]]:
    """Each live descendant of `pid` with its command line; none once `pid` is gone."""
    found = []
    try:
        for process in psutil.Process(pid).children(recursive=True):
            try:
                found.append((process, " ".join(process.cmdline())))
            except psutil.Error:  # it ended meanwhile
                pass
    except psutil.Error:
        pass
    return found


def test_ctrl_c_while_the_early_forkserver_preloads_ends_it_and_leaves_nothing(tmp_path):
    """A stop in the window the early start opens: the forkserver runs while the launcher is still
    importing torch. Exit 130 in one line; the forkserver, its resource tracker and their
    directories are gone."""
    config = write_config(tmp_path / "ds.json")
    launcher = subprocess.Popen([sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2",
                                 str(WORKERS / "toy_train.py"), "--deepspeed", str(config)],
                                cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    started, seen = time.monotonic(), []
    try:
        while time.monotonic() - started < 60 and launcher.poll() is None:
            if any("multiprocessing.forkserver" in line for _, line in children_of(launcher.pid)):
                break
            time.sleep(0.01)
        found = [(p, line) for p, line in children_of(launcher.pid) if "multiprocessing." in line]  # + its tracker
        assert any("forkserver" in line for _, line in found), "no forkserver appeared"
        seen = [p for p, _ in found]
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, stderr
    assert "stopped by SIGINT" in stderr and "Traceback" not in stderr
    for process in seen:
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, process
    left = [path for root in {tempfile.gettempdir(), "/tmp"} for path in Path(root).glob(f"autotuner-*-{launcher.pid}-*")]
    assert not left, left
