"""Faults during tuning: each is recorded, none is fatal, and no process is left behind.

Launches are the cost here (~10 s each on 2 CPU cores), so one tuning run with a fixed
micro-batch list carries several faults (one per micro-batch, via the toy's
--fault_at_micro) and several tests read its records.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from pathlib import Path

import pytest

from autotuner.tuning.space.records import TrialResult
from conftest import assert_no_children_left, tune
from process_checks import (EXPS, HANG_ONCE, RESULTS, assert_no_tmp_files, assert_pids_dead, launched_again,
                            assert_processes_ended, launchers_of, output, pids_in, record, start_tuner, stop, table,
                            wait_for, write_config)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 2**20
# Spaces, both quotes, $, backslash, glob and shell operators: must reach the script as one argument.
NOTE = """a b  "double" 'single' $HOME ${X} $(echo pwned) `id` \\ back * ; && | end"""


# ----- one run, many faults -----
# micro-batch 2 succeeds; 3: rank 1 raises; 4: rank 1 is SIGKILLed; 5: exits 0 before any
# metrics; 6: holds 4 x 64 MiB more than micro-batch 2, over the budget -> OOM.
MIXED_BUDGET = 576 * MiB


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mixed")
    config = write_config(tmp_path / "ds.json", {"memory_per_rank_bytes": MIXED_BUDGET, "tuner_early_stopping": 50},
                          train_micro_batch_size_per_gpu=[2, 3, 4, 5, 6])
    result = tune(tmp_path, config, "--fail_rank", "1", "--kill_rank", "1", "--fail_at_step", "2",
                  "--exit_at_step", "2", "--fault_at_micro", "3:fail", "--fault_at_micro", "4:kill",
                  "--fault_at_micro", "5:exit", "--mem_per_sample_mb", "64", "--pid_dir", tmp_path / "pids",
                  "--echo_args_to", tmp_path / "echo.txt", "--note", NOTE)
    assert_no_children_left()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path, result


def test_every_fault_is_recorded_and_tuning_goes_on(mixed):
    tmp_path, result = mixed
    rows = table(tmp_path)
    assert list(rows.name) == [f"z0_gas1_mbs{m}" for m in (2, 3, 4, 5, 6)]
    assert list(rows.state) == ["ok", "failed", "failed", "failed", "oom"]
    summary = (tmp_path / RESULTS / "summary.txt").read_text()
    assert summary in result.stdout and "Total number of experiments: 5." in summary
    assert "z0_gas1_mbs2 is the optimal setup" in result.stdout
    assert (tmp_path / RESULTS / "ds_config_optimal.json").exists()
    # 2 ranks x 5 experiments (and any launched again after interference), all gone
    assert_pids_dead(tmp_path / "pids", expected=2 * (5 + launched_again(tmp_path / EXPS)))


def test_a_rank_that_raises_is_recorded_as_failed_with_its_rank_and_exception(mixed):
    tmp_path, _ = mixed
    rec = record(tmp_path, "z0_gas1_mbs3")
    assert rec["state"] == "failed"
    assert rec["error"].startswith("rank 1: ")
    # The failing rank's own line, not the follow-on gloo error of its peer (rank 0).
    assert "RuntimeError: injected failure on rank 1" in rec["error"], rec["error"]


def test_a_sigkilled_rank_is_recorded_as_failed_naming_the_rank(mixed):
    tmp_path, _ = mixed
    rec = record(tmp_path, "z0_gas1_mbs4")
    assert rec["state"] == "failed"
    assert rec["error"].startswith("rank 1: ")
    assert "launcher: rank 1 exited with status 137" in (tmp_path / EXPS / "z0_gas1_mbs4" / "stderr.log").read_text()


def test_exit_0_without_metrics_is_recorded_as_failed(mixed):
    tmp_path, _ = mixed
    rec = record(tmp_path, "z0_gas1_mbs5")
    assert rec["state"] == "failed"
    assert "no metrics" in rec["error"]


def test_measured_peak_over_the_budget_is_recorded_as_oom(mixed):
    tmp_path, _ = mixed
    ok, oom = record(tmp_path, "z0_gas1_mbs2"), record(tmp_path, "z0_gas1_mbs6")
    assert oom["state"] == "oom"
    assert "budget" in oom["error"] and f"{MIXED_BUDGET // MiB} MiB" in oom["error"]
    assert oom["measured_memory_bytes"] > MIXED_BUDGET >= ok["measured_memory_bytes"]
    assert oom["measured_memory_bytes"] - ok["measured_memory_bytes"] > 200 * MiB  # 4 x 64 MiB more


def test_records_are_written_without_leaving_temporary_files(mixed):
    tmp_path, _ = mixed
    assert_no_tmp_files(tmp_path / EXPS, tmp_path / RESULTS)
    for name in ("z0_gas1_mbs2", "z0_gas1_mbs3", "z0_gas1_mbs4", "z0_gas1_mbs5", "z0_gas1_mbs6"):
        assert TrialResult.from_json(record(tmp_path, name)).name == name


def test_arguments_reach_every_experiment_unmangled_and_cmd_optimal_round_trips(mixed):
    tmp_path, _ = mixed
    lines = (tmp_path / "echo.txt").read_text().splitlines()
    assert len(lines) == 5 + launched_again(tmp_path / EXPS)  # rank 0 of every launch
    for line in lines:
        argv = line.split("\x1f")
        assert argv[argv.index("--note") + 1] == NOTE, argv
    for exp in sorted((tmp_path / EXPS).iterdir()):
        command = shlex.split((exp / "cmd.txt").read_text())
        assert command[command.index("--note") + 1] == NOTE
    command = shlex.split((tmp_path / RESULTS / "cmd_optimal.txt").read_text())
    assert command[command.index("--note") + 1] == NOTE
    assert command[command.index("--micro_batch_size") + 1] == "2"
    assert command[command.index("--deepspeed") + 1] == str((tmp_path / RESULTS / "ds_config_optimal.json").resolve())


def test_experiment_logs_carry_no_misleading_autotuning_note(mixed):
    tmp_path, _ = mixed
    for log in (tmp_path / EXPS).glob("*/stderr.log"):
        assert "--autotuning was not given" not in log.read_text(), log


# ----- hang -----
# The limit is for every experiment: it leaves the healthy one (a warm launch, 0.3 s here, a few
# seconds on a busy machine) room, and the hung one waits all of it out, a second of the test each.
HANG_TIMEOUT_S = 6


def test_a_hung_experiment_times_out_its_tree_is_ended_and_tuning_goes_on(tmp_path, no_orphans):
    # The hanging micro-batch first: the tuner must go on to the next one after the timeout.
    config = write_config(tmp_path / "ds.json", {"exp_timeout_s": HANG_TIMEOUT_S},
                          train_micro_batch_size_per_gpu=[4, 2])
    started = time.monotonic()
    result = tune(tmp_path, config, "--hang_at_step", "2", "--fault_min_micro", "4", "--pid_dir", tmp_path / "pids")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 120
    hung = record(tmp_path, "z0_gas1_mbs4")
    assert hung["state"] == "timeout" and f"exp_timeout_s={HANG_TIMEOUT_S}" in hung["error"]
    # SIGTERM, then SIGKILL after a 10 s grace at most
    assert HANG_TIMEOUT_S <= hung["wall_time_s"] < HANG_TIMEOUT_S + 15
    assert record(tmp_path, "z0_gas1_mbs2")["state"] == "ok"
    assert "Total number of experiments: 2." in result.stdout
    assert_pids_dead(tmp_path / "pids", expected=4)  # the hung experiment's ranks did start, and are gone


# ----- nothing succeeds -----
def test_when_every_experiment_fails_results_are_still_written_and_the_exit_is_1(tmp_path, no_orphans):
    # Every run's measured peak (~300 MiB on CPU) is over a 100 MiB budget: every experiment is OOM.
    config = write_config(tmp_path / "ds.json", {"memory_per_rank_bytes": 100 * MiB})
    result = tune(tmp_path, config, "--pid_dir", tmp_path / "pids")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no experiment succeeded" in result.stderr and "Traceback" not in result.stderr
    rows = table(tmp_path)
    assert list(rows.name) == ["z0_gas1_mbs2", "z0_gas1_mbs4"] and set(rows.state) == {"oom"}
    summary = (tmp_path / RESULTS / "summary.txt").read_text()
    assert "Total number of experiments: 2." in summary and summary in result.stdout
    assert not (tmp_path / RESULTS / "ds_config_optimal.json").exists()
    assert not (tmp_path / RESULTS / "cmd_optimal.txt").exists()
    assert_pids_dead(tmp_path / "pids", expected=4)


# ----- resume -----
def test_a_failure_after_resuming_a_finished_ok_experiment_is_not_fatal(tmp_path, no_orphans):
    # An earlier run of the same command measured micro-batch 2 (ok) and was stopped before 4: its
    # record of 4 is removed. The resumed run's first launch (4) fails, which is not "the first
    # experiment failed" since 2 is already known.
    config = write_config(tmp_path / "ds.json")
    args = ("--fail_rank", "1", "--fault_min_micro", "4")
    assert tune(tmp_path, config, *args).returncode == 0
    shutil.rmtree(tmp_path / EXPS / "z0_gas1_mbs4")
    result = tune(tmp_path, config, *args)
    assert "z0_gas1_mbs2: ok (from an earlier run)" in result.stdout
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert record(tmp_path, "z0_gas1_mbs4")["state"] == "failed"
    assert "Total number of experiments: 2." in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_ends_every_rank_keeps_finished_records_and_resume_reuses_them(tmp_path, sig, no_orphans):
    config = write_config(tmp_path / "ds.json")
    pids, hung = tmp_path / "pids", tmp_path / "hung"
    args = (*HANG_ONCE, "--hang_once_file", hung, "--pid_dir", pids)
    tuner = start_tuner(tmp_path, config, *args)
    try:
        # Experiment 1 (mbs 2) finishes and writes 2 pid files; experiment 2 (mbs 4) hangs after 2 more.
        wait_for(lambda: hung.exists() and len(pids_in(pids)) >= 4, 120, "experiment 2's ranks", tuner)
        launchers = launchers_of(pids)
        assert launchers, "experiment 2's ranks should be running (hung) now"
        os.kill(tuner.pid, sig)
        returncode = tuner.wait(timeout=60)
    finally:
        stop(tuner)
    out, err = output(tmp_path)
    assert returncode == 128 + sig, out[-2000:] + err[-2000:]
    assert "Resume with the same command" in err and "Traceback" not in err
    first = tmp_path / EXPS / "z0_gas1_mbs2" / "exp.json"
    assert record(tmp_path, "z0_gas1_mbs2")["state"] == "ok"
    assert not (tmp_path / EXPS / "z0_gas1_mbs4" / "exp.json").exists()  # interrupted: no verdict recorded
    assert_pids_dead(pids, expected=4)
    assert_processes_ended(launchers)  # in a session of its own: not our descendant once the tuner is gone
    assert_no_children_left()
    kept_mtime = first.stat().st_mtime_ns

    # Resume: the same command reuses experiment 1 and runs experiment 2 (no hang the second time).
    result = tune(tmp_path, config, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "z0_gas1_mbs2: ok (from an earlier run)" in result.stdout
    assert "z0_gas1_mbs4: ok" in result.stdout and "z0_gas1_mbs4: ok (from an earlier run)" not in result.stdout
    assert first.stat().st_mtime_ns == kept_mtime
    assert len(pids_in(pids)) == 6  # only experiment 2 was launched again
    assert "Total number of experiments: 2." in result.stdout
    assert list(table(tmp_path).state) == ["ok", "ok"]
    assert_pids_dead(pids, expected=6)
    assert_no_tmp_files(tmp_path / EXPS, tmp_path / RESULTS)


def test_overwrite_true_relaunches_finished_experiments(tmp_path, no_orphans):
    pids = tmp_path / "pids"
    config = write_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=[2])
    assert tune(tmp_path, config, "--pid_dir", pids).returncode == 0
    first = tmp_path / EXPS / "z0_gas1_mbs2" / "exp.json"
    before = first.stat().st_mtime_ns

    config = write_config(tmp_path / "ds.json", {"overwrite": True}, train_micro_batch_size_per_gpu=[2])
    result = tune(tmp_path, config, "--pid_dir", pids)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "from an earlier run" not in result.stdout
    assert "z0_gas1_mbs2: ok" in result.stdout
    assert first.stat().st_mtime_ns != before
    assert_pids_dead(pids, expected=4)  # launched twice


# ----- lock -----
def test_a_second_tuner_on_the_same_results_dir_is_refused_while_the_first_runs(tmp_path, no_orphans):
    pids = tmp_path / "pids"
    config = write_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=[2])
    tuner = start_tuner(tmp_path, config, "--hang_at_step", "2", "--pid_dir", pids)
    try:
        wait_for(lambda: len(pids_in(pids)) >= 2, 120, "the first tuner's ranks", tuner)
        launchers = launchers_of(pids)
        # Same results_dir, its own exps_dir and pid dir: so anything it launched would show.
        second_config = write_config(tmp_path / "ds2.json", {"exps_dir": "exps_second"},
                                     train_micro_batch_size_per_gpu=[2])
        second = tune(tmp_path, second_config, "--pid_dir", tmp_path / "pids_second")
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "locked" in second.stderr and second.stderr.startswith("launcher: error:")
        assert len(second.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "exps_second").exists() and not (tmp_path / "pids_second").exists()
        assert tuner.poll() is None  # the first is untouched
        os.kill(tuner.pid, signal.SIGTERM)
        assert tuner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        stop(tuner)
    assert_pids_dead(pids, expected=2)
    assert_processes_ended(launchers)


def test_resuming_with_a_changed_argument_sets_the_earlier_records_aside_and_tunes_afresh(tmp_path, no_orphans):
    """Real launches: the same command with --width 128 instead of 64 must not reuse any record."""
    config = write_config(tmp_path / "ds.json")
    first = tune(tmp_path, config, "--width", "64")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = tune(tmp_path, config, "--width", "128")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "2 earlier records are from a different run (script arguments changed): not reused" in second.stdout
    assert "(from an earlier run)" not in second.stdout
    kept = list((tmp_path / EXPS / "earlier").glob("*/z0_gas1_mbs2/exp.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["fingerprint"]["script_args"] == ["--width", "64"]
    assert record(tmp_path, "z0_gas1_mbs2")["state"] == "ok"  # measured again, for --width 128
    third = tune(tmp_path, config, "--width", "128")
    assert third.stdout.count("(from an earlier run)") == 2 and "different run" not in third.stdout
