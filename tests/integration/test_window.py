"""Profile windows long enough to trust, and the machine's load during them
(runtime/measure/timers.py ProfileWindow, runtime/measure/window_load.py)."""

from __future__ import annotations

from autotuner.runtime.measure.timers import ProfileWindow
from autotuner.runtime.measure.window_load import others_share


def test_a_short_window_is_extended_until_it_has_lasted_long_enough():
    window = ProfileWindow(3, 5, min_window_s=1.0, max_steps=100)
    agreed = []
    for step in range(1, 40):
        window.record_step(step, 0.01, 0.2)
        if step == window.end_step and not window.extend_if_short(step, lambda s: agreed.append(s) or s):
            break
    assert step == 7 and window.planned_end_step == 5  # 5 steps of 0.2 s reach 1 s
    assert len(window.step_wall_s) == 5 and agreed[-1] >= 1.0


def test_the_ranks_agree_on_the_longest_figure_and_the_step_cap_holds():
    window = ProfileWindow(1, 2, min_window_s=10.0, max_steps=4)
    for step in range(1, 20):
        window.record_step(step, 0.01, 0.1)
        # Another rank's clock says the window is already long enough: every rank stops together.
        if step == window.end_step and not window.extend_if_short(step, lambda s: 11.0):
            break
    assert step == 2
    capped = ProfileWindow(1, 2, min_window_s=10.0, max_steps=4)
    for step in range(1, 20):
        capped.record_step(step, 0.01, 0.1)
        if step == capped.end_step and not capped.extend_if_short(step, lambda s: s):
            break
    assert step == 4 and len(capped.step_wall_s) == 4


def test_a_fixed_window_is_never_extended():
    window = ProfileWindow(3, 5)
    assert not window.extend_if_short(5, lambda s: 0.0)


def test_the_share_other_processes_took_is_per_node():
    # figures: own CPU s, node busy s, wall s, CPUs, node index
    quiet = [[0.9, 1.9, 1.0, 2, 0], [0.95, 1.9, 1.0, 2, 0]]
    assert others_share(quiet) < 0.05
    busy = [[0.6, 2.0, 1.0, 2, 0], [0.6, 2.0, 1.0, 2, 0]]  # our ranks had 1.2 of 2 CPU-seconds
    assert abs(others_share(busy) - 0.4) < 1e-9
    two_nodes = [[0.9, 1.0, 1.0, 2, 0], [0.5, 1.5, 1.0, 2, 1]]
    assert abs(others_share(two_nodes) - 0.5) < 1e-9  # node 1: a second process took a core
    assert others_share([[0.01, 0.03, 0.02, 2, 0]]) is None  # 20 ms: two clock ticks say nothing


# ----- real processes -----

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from conftest import WORKERS, run_launcher  # noqa: E402

MAPPINGS = {"train_micro_batch_size_per_gpu": "--micro_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def tune_toy(tmp_path, *script_args: str, **autotuning):
    config = {"train_micro_batch_size_per_gpu": [4], "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "arg_mappings": MAPPINGS, "start_profile_step": 2,
                             "end_profile_step": 4, "exp_timeout_s": 120, "remeasure_rounds": 0, **autotuning}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "2", WORKERS / "toy_train.py", *script_args,
                          "--deepspeed", tmp_path / "ds.json", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "autotuning_exps" / "z0_gas1_mbs4" / "metrics.json").read_text())
    return result, metrics


@pytest.mark.slow
def test_a_measured_window_lasts_min_window_s_and_a_script_that_stops_first_keeps_its_measurement(tmp_path,
                                                                                                no_orphans):
    long_run = tmp_path / "long"
    long_run.mkdir()
    _, metrics = tune_toy(long_run, "--steps", "200", "--ms_per_step", "20", min_window_s=0.5)
    steps = metrics["end_profile_step"] - metrics["start_profile_step"] + 1
    assert metrics["start_profile_step"] == 2 and steps > 3  # extended past the planned end, step 4
    # The ranks stop on the longest rank's clock; rank 0's own sum may be a hair shorter.
    assert sum(metrics["step_wall_s_values"]) >= 0.45 and len(metrics["step_wall_s_values"]) == steps
    assert 0.0 <= metrics["cpu_taken_by_others"] < 1.0 and metrics["load_average"] is not None
    short_run = tmp_path / "short"
    short_run.mkdir()
    # The script ends at step 6, before a 60 s window could: the measurement of steps 2-4 stands.
    _, metrics = tune_toy(short_run, "--steps", "6", "--ms_per_step", "20", min_window_s=60)
    assert (metrics["start_profile_step"], metrics["end_profile_step"]) == (2, 4)


@pytest.mark.slow
def test_a_window_shared_with_a_busy_process_is_seen_and_measured_again(tmp_path, no_orphans):
    # Two busy loops on this machine's CPUs, beside the experiment's two ranks.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        result, metrics = tune_toy(tmp_path, "--steps", "200", "--ms_per_sample", "5", min_window_s=1.0)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    exps = tmp_path / "autotuning_exps"
    disturbed = json.loads((exps / "z0_gas1_mbs4_disturbed" / "metrics.json").read_text())
    assert disturbed["cpu_taken_by_others"] >= 0.25, disturbed["cpu_taken_by_others"]  # kept, not dropped
    assert "other processes took" in result.stdout + result.stderr and "measuring it again" in result.stdout + \
        result.stderr
    # Every launch is a record, the repeat included: one directory each, as many as the summary counts.
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    launches = int(re.search(r"Launches: (\d+)", summary).group(1))
    assert launches == sum(1 for d in exps.iterdir() if (d / "request.json").exists()) >= 2, summary
    assert "launched again after interference" in summary
