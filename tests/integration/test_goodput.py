"""metric "goodput" with real processes (issue 50): the profile's 2-rank DDP launches read the
gradient noise scale, every candidate is scored by throughput x efficiency, the summary compares
the throughput and goodput picks, and the optimal config's learning rate follows its batch."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import experiments_table, launcher_env, tune, tune_command, write_config

pytestmark = pytest.mark.slow

GOODPUT = {"metric": "goodput", "reference_batch_size": 8, "lr_scaling": "linear",
           "max_train_micro_batch_size_per_gpu": 32, "tuner_type": "gridsearch"}


def test_a_goodput_tune_measures_the_noise_scale_and_scales_the_learning_rate(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", GOODPUT)
    result = tune(tmp_path, config, "--ms_per_micro_step", "20", "--steps", "12", "--teacher")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"goodput: gradient noise scale B_noise = ([\d.]+) \+/- ([\d.]+) samples \((\d+) steps",
                      result.stdout)
    assert found, result.stdout[-3000:]
    b_noise = float(found.group(1))
    assert b_noise > 0 and int(found.group(3)) >= 3
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[(table.state == "ok") & (table.phase != "remeasure")]
    batch = ok.micro_batch_size * ok.gradient_accumulation_steps * 2
    expected = ok.throughput_samples_s * (b_noise + 8) / (b_noise + batch)
    assert ok.metric_value.tolist() == pytest.approx(expected.tolist(), rel=0.02)  # every value is goodput
    chosen = table[table.chosen].iloc[0]
    assert chosen.metric_value == pytest.approx(ok.metric_value.max(), rel=1e-6)
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "Goodput: gradient noise scale B_noise" in summary and "Estimated time to the same loss" in summary
    pick_batch = int(chosen.micro_batch_size * chosen.gradient_accumulation_steps * 2)
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["optimizer"]["params"]["lr"] == pytest.approx(0.001 * pick_batch / 8)
    assert f"(linear, global batch {pick_batch} against reference_batch_size 8)" in summary


def test_where_the_noise_cannot_be_read_one_line_says_so_and_throughput_decides(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", GOODPUT, zero_optimization={"stage": 3})
    result = tune(tmp_path, config, "--ms_per_micro_step", "20")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "goodput: the gradient noise scale was not measured (it is read on our engine at ZeRO 0 or 1, around " \
           "the all-reduce with two ranks or more, or over the micro-steps of one rank's gradient accumulation" \
           in result.stdout
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[table.state == "ok"]
    assert ok.metric_value.tolist() == pytest.approx(ok.throughput_samples_s.tolist(), rel=1e-6)
    # The summary says so too, and the learning rate still follows the pick's global batch.
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "Goodput: the gradient noise scale was not measured, so the pick is by throughput" in summary
    chosen = table[table.chosen].iloc[0]
    pick_batch = int(chosen.micro_batch_size * chosen.gradient_accumulation_steps * 2)
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["optimizer"]["params"]["lr"] == pytest.approx(0.001 * pick_batch / 8)


def test_a_critical_batch_from_the_config_scores_goodput_where_the_noise_cannot_be_read(tmp_path, no_orphans):
    config = write_config(tmp_path / "ds.json", {**GOODPUT, "critical_batch_size": 64},
                          zero_optimization={"stage": 3})
    result = tune(tmp_path, config, "--ms_per_micro_step", "20")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "goodput: critical batch 64 (autotuning.critical_batch_size; the profile did not measure B_noise); " \
           "each candidate scores its throughput x (64 + 8) / (64 + its global batch)" in result.stdout
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[(table.state == "ok") & (table.phase != "remeasure")]
    batch = ok.micro_batch_size * ok.gradient_accumulation_steps * 2
    assert ok.metric_value.tolist() == pytest.approx((ok.throughput_samples_s * 72 / (64 + batch)).tolist(), rel=0.02)
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "Goodput: critical batch 64 (autotuning.critical_batch_size; the profile's B_noise not measured)" in summary


def test_goodput_with_a_fixed_global_batch_is_refused(tmp_path):
    config = write_config(tmp_path / "ds.json", GOODPUT, train_batch_size=32)
    result = tune(tmp_path, config)
    assert result.returncode == 2
    assert "train_batch_size: got 32; metric \"goodput\" picks the global batch" in result.stderr
    assert not (tmp_path / "autotuning_exps").exists()


def test_one_rank_reads_the_noise_over_the_micro_steps_of_its_gradient_accumulation(tmp_path, no_orphans):
    # max_train_batch_size 32 on one rank: the profile's micro-batch 1 accumulates 32 micro-steps.
    config = write_config(tmp_path / "ds.json", {**GOODPUT, "max_train_batch_size": 32},
                          gradient_accumulation_steps="auto")
    result = subprocess.run(tune_command(config, "--ms_per_micro_step", "2", "--steps", "12", "--teacher",
                                         nproc_per_node=1),
                            cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"goodput: gradient noise scale B_noise = ([\d.]+) \+/- ([\d.]+) samples \((\d+) steps",
                      result.stdout)
    assert found, result.stdout[-3000:]
    assert float(found.group(1)) > 0 and int(found.group(3)) >= 3
    # The cap fills each candidate's gas, which leaves goodput no batch to trade: said in one line.
    assert "goodput: max_train_batch_size 32 sets each candidate's gradient accumulation to fill it" in result.stdout
    table = experiments_table(tmp_path / "autotuning_results")
    ok = table[(table.state == "ok") & (table.phase != "remeasure")]
    batch = ok.micro_batch_size * ok.gradient_accumulation_steps
    b_noise = float(found.group(1))
    assert ok.metric_value.tolist() == pytest.approx((ok.throughput_samples_s * (b_noise + 8)
                                                      / (b_noise + batch)).tolist(), rel=0.02)
