"""`launcher --autotuning tune|run` end to end on 2 CPU ranks with real launches."""

import json
import re
import shlex
import subprocess
import sys

import pandas as pd
import pytest

from autotuner.config import read_config_file
from conftest import REMEASURED, experiments_table, launcher_env, tune, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def experiments(tmp_path) -> pd.DataFrame:
    table = experiments_table(tmp_path / "autotuning_results")
    return table[table.phase != "remeasure"].reset_index(drop=True)  # one row per experiment


def test_tune_writes_every_output_and_picks_the_best(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", {"max_train_micro_batch_size_per_gpu": 16,
                                                 "max_train_batch_size": 64, **REMEASURED, "history": True})
    result = tune(tmp_path, config, "--ms_per_sample", "1", "--ms_per_step", "20")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    summary = (results / "summary.txt").read_text()
    assert "| tuning_space" in summary and "| global" in summary and "Tuning completed in" in summary
    assert summary in result.stdout

    table = experiments(tmp_path)
    ok = table[table.state == "ok"]
    assert len(ok) >= 2
    # Gas is really tuned under max_train_batch_size: 64 = micro x gas x 2 ranks.
    assert set(ok.gradient_accumulation_steps) == {64 // (2 * m) for m in ok.micro_batch_size}
    assert ok.gradient_accumulation_steps.nunique() > 1
    best = table[table.chosen].iloc[0]  # the pick: the best run, or the best median once re-measured
    assert f"| global         |                 {len(table[table.state != 'pruned'])} |" in summary
    global_row = next(line for line in summary.splitlines() if line.startswith("| global"))
    assert best["name"] in global_row  # the global row names the pick
    # Launches after the profile were predicted before they ran; the profile launches only measured.
    assert (ok[ok.phase != "profile"].predicted_memory_mib > 0).all() and (ok.measured_memory_mib > 0).all()

    exp_dir = tmp_path / "autotuning_exps" / best["name"]
    for name in ("ds_config.json", "cmd.txt", "stdout.log", "stderr.log", "metrics.json", "exp.json"):
        assert (exp_dir / name).exists(), name
    record = json.loads((exp_dir / "exp.json").read_text())["result"]
    assert record["state"] == "ok" and record["value"] == pytest.approx(best["throughput_samples_s"])

    optimal = read_config_file(results / "ds_config_optimal.json")
    assert "autotuning" not in optimal
    assert optimal["train_micro_batch_size_per_gpu"] == best["micro_batch_size"]
    assert optimal["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]
    assert (results / "metric_vs_micro_batch.png").exists()

    command = shlex.split((results / "cmd_optimal.txt").read_text())
    assert "--micro_batch_size" in command and str(best["micro_batch_size"]) in command
    trained = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "done: 8 steps" in trained.stdout

    # Every launch is also a trial in the history database; `launcher --history` lists the run.
    launches = int(re.search(r"Launches: (\d+)", summary).group(1))  # re-measurements are trials too
    assert f"history: {launches} launches recorded in study autotuner:toy_train.py:" in result.stdout
    listed = subprocess.run([sys.executable, "-m", "autotuner", "--history"], cwd=tmp_path, env=launcher_env(),
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr[-2000:]
    row = next(line for line in listed.stdout.splitlines() if "toy_train.py" in line)
    assert best["name"] in row and re.search(rf"\|\s+{launches} \|", row) and "2 ranks" in row
    missing = subprocess.run([sys.executable, "-m", "autotuner", "--history", "sqlite:///nowhere/history.db"],
                             cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("launcher: error: --history: no history database")


def test_run_trains_to_the_end_with_fixed_stage_and_micro_batch(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", {"model_info": {"num_params": 1000}},
                          train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 1})
    result = tune(tmp_path, config, "--steps", "12", mode="run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments(tmp_path)
    assert list(table.name) == ["z1_gas1_mbs4"]  # constants are not tuned
    assert "training with the optimal config" in result.stdout
    assert "done: 12 steps" in result.stdout  # past end_profile_step, to the user's step count


def test_memory_model_prunes_stage0_before_launch(tmp_path, no_orphans):
    # Hand-sized: 20 M params, fp32 Adam, 2 ranks: stage 0 needs ~767 MB, stage 3 ~543 MB; usable 630 MB.
    model_info = {"num_params": 20_000_000, "num_layers": 20, "activation_bytes_per_sample": 2**20,
                  "baseline_bytes": 350 * 2**20}
    config = write_config(tmp_path / "ds.json", {"model_info": model_info, "memory_per_rank_bytes": 700_000_000,
                                                 "max_train_micro_batch_size_per_gpu": 4,
                                                 "num_tuning_micro_batch_sizes": 1},
                          zero_optimization={"stage": [0, 3]})
    result = tune(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments(tmp_path)
    pruned = table[table.state == "pruned"]
    assert list(pruned.zero_stage) == [0]
    assert "memory model" in pruned.error.iloc[0]
    assert not list((tmp_path / "autotuning_exps").glob("z0_*"))  # never launched
    assert list(table[table.state == "ok"].name) == ["z3_gas1_mbs4"]


def test_forced_oom_is_recorded_and_the_search_backs_off(tmp_path, no_orphans):
    # Each sample holds 24 MiB; the memory model is told nothing about it, so it over-predicts.
    budget = 770 * 2**20
    config = write_config(tmp_path / "ds.json", {"model_info": {"num_params": 1000}, "memory_per_rank_bytes": budget,
                                                 "max_train_micro_batch_size_per_gpu": 32,
                                                 "num_tuning_micro_batch_sizes": 1})
    result = tune(tmp_path, config, "--mem_per_sample_mb", "24")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments(tmp_path)
    first = table.iloc[0]
    assert (first["name"], first.state) == ("z0_gas1_mbs32", "oom")
    assert "budget" in first.error
    ok = table[table.state == "ok"]
    assert len(ok) >= 1 and ok.micro_batch_size.max() < 32
    assert (ok.measured_memory_mib * 2**20 <= budget).all()
    assert (table[table.state == "oom"].measured_memory_mib * 2**20 > budget).all()


def test_rejected_mapped_flag_stops_tuning_with_the_scripts_error(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", {"model_info": {"num_params": 1000},
                                                 "arg_mappings": {"train_micro_batch_size_per_gpu": "--no_such_flag"}})
    result = tune(tmp_path, config)
    assert result.returncode == 1
    assert "unrecognized arguments: --no_such_flag" in result.stderr
    assert len(list((tmp_path / "autotuning_exps").iterdir())) == 1  # reported once; nothing more launched
    assert "Traceback" not in result.stderr


def test_the_predictive_tuner_launches_a_fraction_of_the_candidates_and_explains_itself(tmp_path, no_orphans):
    """Micro-batches above 8 are 4x slower per sample (--slow_above 8), so the optimum is not the
    largest size that fits. The profile launches count as experiments: 8 (the smallest size with
    gas <= 8; 1 would run gas 64) and 32 (half the largest predicted to fit). The throughput model
    rules out what cannot win."""
    config = write_config(tmp_path / "ds.json", {"tuner_type": "predictive", "max_train_batch_size": 128,
                                                 "max_train_micro_batch_size_per_gpu": 64})
    result = tune(tmp_path, config, "--ms_per_sample", "4", "--slow_above", "8")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments(tmp_path)
    assert list(table[table.phase == "profile"].micro_batch_size) == [8, 32]
    launched = table[table.state != "pruned"]
    assert len(launched) < 6  # the candidates: 2, 4, 8, 16, 32, 64 (1 only where nothing larger fits)
    chosen = table[table.chosen].iloc[0]
    assert chosen.micro_batch_size <= 8, table.to_string()
    search = table[table.phase == "search"]
    assert len(search) and search.predicted_metric.notna().all()
    assert (search.predicted_metric_low <= search.predicted_metric_high).all()
    assert search.why_launched.str.contains("predicted").all(), search.why_launched.tolist()
    assert (table[table.phase == "profile"].why_launched.str.startswith("profile")).all()
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "Throughput model: 6 candidates; prediction ruled out" in summary
    assert all(f"  {name}: " in summary for name in search.name), summary  # why each searched launch ran
    assert "Memory model, predicted before each launch: error" in summary
    assert (tmp_path / "autotuning_results" / "metric_vs_micro_batch.png").exists()


def test_full_mode_with_the_bayes_tuner(tmp_path, no_orphans):
    pytest.importorskip("optuna", reason="tuner_type bayes needs pip install 'autotuner[bayes]'")
    config = write_config(tmp_path / "ds.json", {"fast": False, "tuner_type": "bayes", "tuner_num_trials": 3,
                                                 "max_train_micro_batch_size_per_gpu": 8},
                          zero_optimization={"stage": 0, "reduce_bucket_size": [1_000_000, 50_000_000],
                                             "contiguous_gradients": [False, True]})
    result = tune(tmp_path, config, "--ms_per_sample", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments(tmp_path)
    knob_runs = table[table.name.str.contains("_rbs")]
    # The knob stage: at most tuner_num_trials launches, each a distinct point of the 2 x 2 x 2 grid.
    assert 1 <= len(knob_runs) <= 3 and knob_runs.name.is_unique
    assert (knob_runs.state == "ok").all()
    assert (tmp_path / "autotuning_results" / "ds_config_optimal.json").exists()


@pytest.mark.slow
def test_a_deeper_model_of_the_same_family_is_tuned_from_the_shallower_ones_run(tmp_path, no_orphans):
    """Two real predictive tunes sharing a history: the second (twice the blocks) reads the first's
    study, scales it to its own model and checks it against its profile launches: used or
    dropped, one line names it, and the summary says so."""
    optuna = pytest.importorskip("optuna")
    from conftest import MINIMAL

    storage = f"sqlite:///{tmp_path / 'history.db'}"
    autotuning = {"tuner_type": "predictive", "history": True, "storage": storage, "max_train_batch_size": 32,
                  "max_train_micro_batch_size_per_gpu": 16}
    runs = {}
    for depth in (2, 4):
        cwd = tmp_path / f"depth{depth}"
        cwd.mkdir()
        config = write_config(cwd / "ds.json", autotuning)
        result = tune(cwd, config, "--width", "128", "--depth", str(depth), "--steps", "20", script=MINIMAL)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[depth] = result
    studies = {s.study_name: s.user_attrs for s in optuna.get_all_study_summaries(storage)}
    assert len(studies) == 2
    (first, first_attrs), (_, second_attrs) = sorted(studies.items(), key=lambda kv: kv[1]["last_run_unix"])
    assert first_attrs["signature"]["family"] == second_attrs["signature"]["family"] != ""
    assert second_attrs["signature"]["num_params"] > first_attrs["signature"]["num_params"]
    assert not any(line.startswith("autotuner: transfer:") for line in runs[2].stdout.splitlines())
    said = [line for line in runs[4].stdout.splitlines() if line.startswith("autotuner: transfer:")]
    assert len(said) == 1 and first in said[0] and ("using" in said[0] or "dropped" in said[0]), runs[4].stdout
    summary = (tmp_path / "depth4" / "autotuning_results" / "summary.txt").read_text()
    assert said[0].removeprefix("autotuner: ") in summary
