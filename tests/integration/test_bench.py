"""`launcher --bench`: the statistics and lines it prints, the errors caught before any launch,
and real 1- and 2-rank runs of the toy worker whose numbers the CSV must carry."""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

import pytest

from autotuner.app.cli import main
from autotuner.app.bench import (
    Baseline,
    BenchResult,
    ThroughputStats,
    baseline_of,
    efficiency_line,
    total_line,
    write_csv,
)
from conftest import TOY, run_launcher, write_json
SGD = {"type": "SGD", "params": {"lr": 0.01}}


def ok(world_size: int, samples_per_s: float, ci95: float = 0.0, iterations: int = 5) -> BenchResult:
    return BenchResult(world_size, stats=ThroughputStats(samples_per_s, ci95, iterations))


def write_config(tmp_path: Path, **values) -> Path:
    return write_json(tmp_path / "ds.json", {"optimizer": SGD, **values})


# ----- statistics and formatting -----

def test_stats_are_mean_and_1_96_population_std_of_per_step_rates():
    stats = ThroughputStats.of(8, [0.01, 0.02, 0.04])  # 800, 400, 200 samples/s
    rates = [800.0, 400.0, 200.0]
    assert stats.samples_per_s == pytest.approx(statistics.fmean(rates))
    assert stats.ci95 == pytest.approx(1.96 * statistics.pstdev(rates))
    assert stats.iterations == 3


def test_stats_need_a_positive_step_time():
    with pytest.raises(ValueError, match="no positive step times"):
        ThroughputStats.of(8, [0.0])


def test_total_line_is_bluefog_form():
    assert total_line(ok(2, 1234.567, 89.04)) == "Total samples/sec on 2 rank(s): 1234.6 +- 89.0"


def test_efficiency_against_one_rank():
    results = [ok(1, 100.0), ok(2, 180.0), ok(4, 300.0)]
    baseline = baseline_of(results)
    assert baseline == Baseline(1, 100.0)
    assert [efficiency_line(r, baseline) for r in results] == [
        "Scaling efficiency on 1 rank(s): 100.0% (baseline: 1 rank)",
        "Scaling efficiency on 2 rank(s): 90.0% (baseline: 1 rank)",
        "Scaling efficiency on 4 rank(s): 75.0% (baseline: 1 rank)",
    ]


def test_efficiency_without_one_rank_uses_the_smallest_size_per_rank():
    results = [ok(4, 300.0), ok(2, 200.0)]
    baseline = baseline_of(results)
    assert baseline == Baseline(2, 100.0)
    assert efficiency_line(results[0], baseline) == "Scaling efficiency on 4 rank(s): 75.0% (baseline: 2 ranks, per rank)"


def test_failed_sizes_are_not_a_baseline_and_keep_their_error_in_the_csv(tmp_path):
    results = [BenchResult(1, error="rank 0: RuntimeError: boom"), ok(2, 200.0, 10.0, 6), ok(4, 360.0, 20.0, 6)]
    assert baseline_of(results) == Baseline(2, 100.0)
    assert baseline_of([BenchResult(1, error="x")]) is None
    write_csv(tmp_path / "bench.csv", results)
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["world_size"] for r in rows] == ["1", "2", "4"]
    assert rows[0]["samples_per_s"] == "" and rows[0]["iterations"] == "0" and "boom" in rows[0]["error"]
    assert float(rows[1]["efficiency"]) == pytest.approx(1.0) and float(rows[2]["efficiency"]) == pytest.approx(0.9)
    assert rows[2]["ci95"] == "20.000" and rows[2]["iterations"] == "6"


def test_measurement_carries_per_step_times_and_round_trips():
    from autotuner.core.boundary import Measurement
    from autotuner.runtime.measure.metrics import build_measurement
    from autotuner.runtime.measure.timers import ProfileWindow

    window = ProfileWindow(2, 4, step_wall_s=[0.1, 0.2, 0.3])
    measurement = build_measurement(window, train_batch_size=8, world_size=2, micro_batch_size=4,
                                    gradient_accumulation_steps=1, zero_stage=0, precision="fp32", peak_memory=1,
                                    peak_memory_per_rank=[1, 1], flops_per_step=None, device_type="cpu")
    data = json.loads(json.dumps(measurement.to_json()))
    assert data["step_wall_s_values"] == [0.1, 0.2, 0.3]
    assert data["step_wall_s"]["count"] == 3  # the summary stays
    assert data["version"] == 1
    assert Measurement.from_json(data) == measurement


# ----- command-line errors: exit 2, one line, nothing launched -----

@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--nproc_per_node", "1,2", "{toy}", "--deepspeed", "{cfg}"], "only allowed with --bench"),
        (["--nproc_per_node", "1,x", "--bench", "{toy}", "--deepspeed", "{cfg}"], "invalid list of ints: '1,x'"),
        (["--nproc_per_node", "two", "{toy}"], "invalid int value: 'two'"),
        (["--bench", "--nproc_per_node", "1,0", "{toy}", "--deepspeed", "{cfg}"], "--nproc_per_node: got 0"),
        (["--bench", "--bench_iters", "1", "{toy}", "--deepspeed", "{cfg}"], "--bench_iters: got 1"),
        (["--bench", "--bench_warmup", "0", "{toy}", "--deepspeed", "{cfg}"], "--bench_warmup: got 0"),
        (["--bench", "{toy}"], "--bench needs the script's config"),
        (["--bench", "--autotuning", "tune", "{toy}", "--deepspeed", "{cfg}"], "give one of them"),
        (["--bench", "--num_nodes", "2", "{toy}", "--deepspeed", "{cfg}"], "--bench runs on one node"),
        (["--bench", "{toy}", "--deepspeed", "{auto}"], "train_micro_batch_size_per_gpu: got 'auto'"),
        (["--bench", "{toy}", "--deepspeed", "{unset}"], "train_micro_batch_size_per_gpu: missing"),
        (["--bench", "{toy}", "--deepspeed", "{stages}"], "zero_optimization.stage: got [1, 2]"),
        (["--bench", "--nproc_per_node", "2,3", "{toy}", "--deepspeed", "{split}"],
         "tensor_parallel.autotp_size 2: does not divide --nproc_per_node 3"),
        (["--bench", "{toy}", "--deepspeed", "{searched}"], 'tensor_parallel.autotp_size: got "auto"'),
    ],
    ids=["list_without_bench", "bad_list", "not_int", "zero_in_list", "one_iter", "no_warmup", "no_config",
         "with_autotuning", "multi_node", "micro_auto", "micro_unset", "stage_list", "tensor_parallel",
         "tensor_parallel_searched"],
)
def test_usage_and_config_errors_exit_2_before_launching(argv, fragment, tmp_path, monkeypatch, capsys):
    configs = {
        "cfg": {"train_micro_batch_size_per_gpu": 4},
        "auto": {"train_micro_batch_size_per_gpu": "auto"},
        "unset": {"train_batch_size": 8},
        "stages": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": [1, 2]}},
        "split": {"train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"autotp_size": 2}},
        "searched": {"train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"autotp_size": "auto"}},
    }
    paths = {}
    for name, values in configs.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({"optimizer": SGD, **values}))
    monkeypatch.chdir(tmp_path)
    assert main([a.format(toy=TOY, **paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("launcher: error:") and fragment in err, err
    assert not (tmp_path / "bench_results").exists()


# ----- real runs -----

TOTAL = r"Total samples/sec on {n} rank\(s\): ([\d.]+) \+- ([\d.]+)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_one_and_two_ranks(tmp_path, no_orphans):
    config = write_config(tmp_path, train_micro_batch_size_per_gpu=4)
    proc = run_launcher("--bench", "--bench_warmup", "2", "--bench_iters", "6", "--nproc_per_node", "1,2",
                        TOY, "--steps", "20", "--ms_per_sample", "1", "--deepspeed", config,
                        cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    totals = {n: re.search(TOTAL.format(n=n), proc.stdout) for n in (1, 2)}
    assert all(totals.values()), proc.stdout
    assert re.search(r"Scaling efficiency on 1 rank\(s\): 100\.0% \(baseline: 1 rank\)", proc.stdout), proc.stdout
    assert re.search(r"Scaling efficiency on 2 rank\(s\): [\d.]+% \(baseline: 1 rank\)", proc.stdout), proc.stdout

    rows = {int(r["world_size"]): r for r in csv.DictReader(open(tmp_path / "bench_results" / "bench.csv"))}
    assert sorted(rows) == [1, 2]
    for n, row in rows.items():
        assert int(row["iterations"]) == 6 and row["error"] == ""
        rate = float(row["samples_per_s"])
        # micro 4 sleeping 1 ms per sample: at most 1000 samples/s per rank, and not absurdly slow
        assert 20 * n < rate < 1000 * n, row
        assert float(totals[n].group(1)) == pytest.approx(rate, abs=0.06)
        assert float(row["ci95"]) >= 0
    assert float(rows[2]["efficiency"]) == pytest.approx(
        float(rows[2]["samples_per_s"]) / (2 * float(rows[1]["samples_per_s"])), rel=1e-3)

    # weak scaling: the 2-rank run kept micro 4 per rank and timed steps 3..8
    run_dir = tmp_path / "bench_results" / "world_size_2"
    ran = json.loads((run_dir / "ds_config.json").read_text())
    assert ran["train_micro_batch_size_per_gpu"] == 4 and ran["train_batch_size"] == 8
    request = json.loads((run_dir / "request.json").read_text())
    assert (request["start_profile_step"], request["end_profile_step"]) == (3, 8) and "autotuning" not in ran
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and len(metrics["step_wall_s_values"]) == 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_size_is_reported_and_exits_1(tmp_path, no_orphans):
    config = write_config(tmp_path, train_micro_batch_size_per_gpu=2)
    proc = run_launcher("--bench", "--bench_warmup", "1", "--bench_iters", "3", "--nproc_per_node", "2,1",
                        TOY, "--steps", "10", "--fail_rank", "1", "--fail_at_step", "2", "--deepspeed", config,
                        cwd=tmp_path, timeout=280)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(TOTAL.format(n=1), proc.stdout), proc.stdout
    assert "Scaling efficiency on 1 rank(s): 100.0% (baseline: 1 rank)" in proc.stdout
    # which exception text classify() quotes depends on which rank logged last; the failing rank does not
    assert re.search(r"launcher: error: bench on 2 rank\(s\) failed: rank 1: .*RuntimeError.*"
                     r"\(see bench_results/world_size_2/stderr\.log\)", proc.stderr), proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "bench_results" / "bench.csv")))
    assert [(r["world_size"], r["iterations"]) for r in rows] == [("1", "3"), ("2", "0")]
