"""Helpers for the tests that tune a toy script through faults and stops: its config, the tuner as a
process, what it left (records, experiments.csv, rank pids), and checks that nothing is left behind.
Shared by the fault, multi-node and DeepSpeed-engine tests, so no test module imports another."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import psutil

from conftest import experiments_table, launcher_env, tune_command, write_config as write_toy_config

# The fault tests count launches and rank pids exactly: the grid search's order and no final
# re-measurement (its own tests are in test_final_pick.py).
FAULT_TUNING = {"model_info": {"num_params": 1000}, "remeasure_rounds": 0}
EXPS, RESULTS = "autotuning_exps", "autotuning_results"
# The toy hangs once, at step 2 of the first experiment of micro-batch 4 or more.
HANG_ONCE = ("--hang_at_step", "2", "--fault_min_micro", "4")


def write_config(path: Path, autotuning: dict | None = None, **top) -> Path:
    return write_toy_config(path, autotuning, tuning_defaults=FAULT_TUNING,
                            **{"train_micro_batch_size_per_gpu": [2, 4], **top})


def start_tuner(tmp_path: Path, config: Path, *script_args: str, name: str = "tuner") -> subprocess.Popen:
    """The tuner in the background, its output in files (a pipe nobody reads could block it)."""
    return subprocess.Popen(tune_command(config, *script_args), cwd=tmp_path, env=launcher_env(),
                            stdout=open(tmp_path / f"{name}.out", "w"), stderr=open(tmp_path / f"{name}.err", "w"),
                            stdin=subprocess.DEVNULL)


def stop(tuner: subprocess.Popen) -> None:
    """Clean-up after a failed assertion: SIGTERM (the tuner ends its experiment), then SIGKILL."""
    if tuner.poll() is None:
        tuner.send_signal(signal.SIGTERM)
        try:
            tuner.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tuner.kill()
            tuner.wait()


def output(tmp_path: Path, name: str = "tuner") -> tuple[str, str]:
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def record(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / EXPS / name / "exp.json").read_text())["result"]


def table(tmp_path: Path) -> pd.DataFrame:
    table = experiments_table(tmp_path / RESULTS)
    return table[table.phase != "remeasure"].reset_index(drop=True)  # one row per experiment


def pids_in(pid_dir: Path) -> list[int]:
    return sorted(int(p.stem) for p in pid_dir.glob("*.pid")) if pid_dir.exists() else []


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the tuner exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def launched_again(exps_dir: Path) -> int:
    """Launches repeated because another process disturbed them (the tuner keeps the first as
    <name>_disturbed beside the repeat): each started its ranks too. Load beside the suite can
    cause them; a test counting launches adds these."""
    from autotuner.tuning.trials.evaluator import DISTURBED_TAG

    return sum(1 for path in exps_dir.iterdir() if path.is_dir() and path.name.endswith(DISTURBED_TAG)) \
        if exps_dir.is_dir() else 0


def assert_pids_dead(pid_dir: Path, expected: int | None = None, grace_s: float = 3.0) -> None:
    """Every rank that wrote `<pid>.pid` has ended. Ranks run in sessions of their own, so an
    orphaned one would not show up as our descendant: check the pids themselves."""
    files = sorted(pid_dir.glob("*.pid"))
    if expected is not None:
        assert len(files) == expected, f"expected {expected} pid files, found {[f.name for f in files]}"

    def alive() -> list[tuple[int, list[str]]]:
        found = []
        for file in files:
            try:
                proc = psutil.Process(int(file.stem))
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.create_time() > file.stat().st_mtime + 1:
                    continue  # the pid was reused by a process started after our rank wrote its file
                found.append((proc.pid, proc.cmdline()))
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return found

    deadline = time.monotonic() + grace_s
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"ranks left running: {left}"


def launchers_of(pid_dir: Path) -> list[psutil.Process]:
    """The experiment launchers (torch elastic agents) whose ranks wrote pid files and still run."""
    parents = {}
    for file in pid_dir.glob("*.pid"):
        try:
            rank = psutil.Process(int(file.stem))
            if rank.create_time() > file.stat().st_mtime + 1:
                continue  # a reused pid
            parent = rank.parent()
        except psutil.NoSuchProcess:
            continue
        if parent is not None:
            parents[parent.pid] = parent
    return list(parents.values())


def assert_processes_ended(processes: list[psutil.Process]) -> None:
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.cmdline()) for p in left]


def assert_no_tmp_files(*dirs: Path) -> None:
    leftovers = [os.path.join(root, name) for d in dirs for root, _, names in os.walk(d)
                 for name in names if name.endswith(".tmp")]
    assert not leftovers, leftovers
