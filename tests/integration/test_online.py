"""Online tuning with real processes: `launcher --autotuning online` on 2 CPU ranks (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import MINIMAL, WORKERS, run_launcher, write_json

pytest.importorskip("optuna", reason="online tuning needs the bayes extra: pip install 'autotuner[bayes]'")
pytestmark = pytest.mark.slow

STEPS = 40
QUICK = {"warmup_samples": 1, "steps_per_sample": 2, "max_samples": 4, "sampling_confidence_time": 0,
         "remeasure_top": 2, "remeasure_windows": 2}


def write_online_config(path: Path, stage: int = 0, gas: int = 1, zero: dict | None = None, online: dict | None = None) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "steps_per_print": 1000,
        "autotuning": {"online": {**QUICK, **(online or {})}},
    }
    return write_json(path, config)


def train(tmp_path: Path, config: Path, name: str, *, online: bool, extra: tuple[str, ...] = ()):
    mode = ("--autotuning", "online") if online else ()
    losses = tmp_path / f"{name}_losses.json"
    result = run_launcher(*mode, "--nproc_per_node", "2", MINIMAL, "--steps", str(STEPS), "--depth", "4",
                          "--losses_out", losses, *extra, "--deepspeed", config, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(losses.read_text())


def read_log(tmp_path: Path) -> pd.DataFrame:
    return pd.read_csv(tmp_path / "autotuning_results" / "online_log.csv", comment="#")


def rank_records(tmp_path: Path) -> list[list[dict]]:
    ranks = tmp_path / "autotuning_results" / "online_ranks"
    return [[json.loads(line) for line in (ranks / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]


def losses_of(data) -> list[float]:
    return data["losses"] if isinstance(data, dict) else data


def check_run(tmp_path: Path, knob_names: list[str]) -> tuple[pd.DataFrame, dict]:
    """The log, the per-rank records and best_knobs.json agree; returns (log, best)."""
    log_path = tmp_path / "autotuning_results" / "online_log.csv"
    assert "score: samples/s" in log_path.read_text().splitlines()[0]
    log = read_log(tmp_path)
    assert list(log.columns) == [*knob_names, "score", "train_iter", "phase"]
    order = ["warmup", "sample", "remeasure", "final"]
    phases = list(log["phase"])
    assert phases[0] == "warmup" and phases[-1] == "final" and phases.count("final") == 1
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)  # phases in order
    assert phases.count("sample") == QUICK["max_samples"]
    assert (log["score"] > 0).all()
    rank0, rank1 = rank_records(tmp_path)
    assert rank0 == rank1  # every rank applied the same knobs at the same step, by its own account
    best = json.loads((tmp_path / "autotuning_results" / "best_knobs.json").read_text())
    final_row = log.iloc[-1]
    assert rank0[-1]["phase"] == "final" and rank0[-1]["knobs"] == best["knobs"]
    assert {name: _plain(final_row[name]) for name in knob_names} == {n: best["knobs"][n] for n in knob_names}
    assert rank0[-1]["train_iter"] == final_row["train_iter"] == best["train_iter"]
    assert best["score"] == pytest.approx(final_row["score"], rel=1e-6)
    assert best["score"] == max(r["median"] for r in best["ranking"])
    # Every point the log says was measured is one the ranks really switched to (or started at).
    applied = {json.dumps(entry["knobs"], sort_keys=True) for entry in rank0}
    for _, row in log.iterrows():
        measured = {name: _plain(row[name]) for name in knob_names}
        assert json.dumps({**rank0[0]["knobs"], **measured}, sort_keys=True) in applied
    return log, best


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def test_ddp_online_run_tunes_consistently_and_trains_like_an_untuned_run(tmp_path):
    config = write_online_config(tmp_path / "ds.json", stage=0)
    result, tuned = train(tmp_path, config, "tuned", online=True)
    assert "online tuning bucket_cap_mb, gradient_as_bucket_view (DDP, 2 ranks)" in result.stdout
    assert "online tuning done at step" in result.stdout
    log, best = check_run(tmp_path, ["bucket_cap_mb", "gradient_as_bucket_view"])
    assert set(log["phase"]) == {"warmup", "sample", "remeasure", "final"}
    assert best["start_knobs"] == {"bucket_cap_mb": 25, "gradient_as_bucket_view": False}
    assert best["start_score"] is not None  # the starting knobs were re-measured beside the pick
    _, plain = train(tmp_path, config, "plain", online=False)
    assert len(losses_of(tuned)) == len(losses_of(plain)) == STEPS  # trained to the last step
    # Bucketing changes only how gradients are grouped for the all-reduce (fp32).
    assert losses_of(tuned) == pytest.approx(losses_of(plain), rel=1e-5, abs=1e-7)


def test_fsdp_online_run_tunes_prefetch_and_resharding_with_unchanged_math(tmp_path):
    config = write_online_config(tmp_path / "ds.json", stage=2, gas=2)
    result, tuned = train(tmp_path, config, "tuned", online=True)
    assert "(FSDP, 2 ranks)" in result.stdout
    check_run(tmp_path, ["forward_prefetch", "backward_prefetch", "reshard_after_backward"])
    _, plain = train(tmp_path, config, "plain", online=False)
    assert len(losses_of(tuned)) == STEPS
    assert losses_of(tuned) == pytest.approx(losses_of(plain), rel=1e-5, abs=1e-7)


def test_knobs_fixed_in_the_config_are_not_tuned(tmp_path):
    config = write_online_config(tmp_path / "ds.json", stage=1, zero={"contiguous_gradients": True})
    result, _ = train(tmp_path, config, "tuned", online=True)
    assert "fixed gradient_as_bucket_view=True (zero_optimization.contiguous_gradients)" in result.stdout
    log, best = check_run(tmp_path, ["bucket_cap_mb"])
    assert "gradient_as_bucket_view" not in log.columns
    assert all(entry["knobs"]["gradient_as_bucket_view"] is True for entry in rank_records(tmp_path)[0])
    assert best["fixed"] == {"gradient_as_bucket_view": {"value": True, "by": "zero_optimization.contiguous_gradients"}}


def test_best_knobs_fed_back_are_applied_and_not_tuned(tmp_path):
    best = tmp_path / "earlier_best_knobs.json"
    best.write_text(json.dumps({"knobs": {"bucket_cap_mb": 4, "gradient_as_bucket_view": True}}))
    config = write_online_config(tmp_path / "ds.json", stage=0, online={"knobs": str(best)})
    result, losses = train(tmp_path, config, "fed", online=True)
    assert "online tuning: nothing to tune at ZeRO stage 0; fixed bucket_cap_mb=4" in result.stdout
    assert len(losses_of(losses)) == STEPS
    rank0, rank1 = rank_records(tmp_path)
    assert rank0 == rank1 == [{"train_iter": 0, "phase": "start",
                               "knobs": {"bucket_cap_mb": 4, "gradient_as_bucket_view": True}}]
    assert not (tmp_path / "autotuning_results" / "online_log.csv").exists()


def test_a_rank_failing_mid_tuning_ends_the_job_cleanly(tmp_path, no_orphans):
    config = write_online_config(tmp_path / "ds.json", stage=0)
    pid_dir = tmp_path / "pids"
    result = run_launcher("--autotuning", "online", "--nproc_per_node", "2", WORKERS / "toy_train.py",
                          "--steps", "30", "--fail_rank", "1", "--fail_at_step", "9", "--pid_dir", pid_dir,
                          "--deepspeed", config, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    # The script's own error is the user's to read (its traceback stays); the launcher names the cause.
    assert "injected failure on rank 1 at step 9" in result.stderr
    assert "launcher: rank 1 failed first" in result.stderr
    log = read_log(tmp_path)
    assert "final" not in set(log["phase"]) and len(log) >= 1  # logged from the first sample
    assert not (tmp_path / "autotuning_results" / "best_knobs.json").exists()
    import psutil

    pids = [int(p.stem) for p in pid_dir.glob("*.pid")]
    assert len(pids) == 2
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("args, config_extra, words", [
    ((), None, ["--autotuning online needs the script's config"]),
    (("--deepspeed", "ds.json"), {"knobs": {"bucket_size": 8}}, ["ds.json", "autotuning.online.knobs",
                                                                  "'bucket_size' is not a knob"]),
], ids=["no-config", "unknown-knob"])
def test_online_usage_errors_exit_2_before_launch(tmp_path, args, config_extra, words):
    write_online_config(tmp_path / "ds.json", online=config_extra)
    result = run_launcher("--autotuning", "online", "--nproc_per_node", "2", MINIMAL, *args, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    for word in words:
        assert word in result.stderr
    assert not (tmp_path / "autotuning_results").exists()
