"""The global batch grown through training (issue 70), with real processes: a goodput tune with
autotuning.adapt_batch, then its pick's training run (`--autotuning run`) reading B_noise and
growing gradient accumulation at the interval's boundaries, on every rank at the same step, the
learning rate following; each change a row of batch_ramp.csv, and the run's summary the ramp."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import tune, write_config

pytestmark = pytest.mark.slow

RAMP = {"metric": "goodput", "reference_batch_size": 8, "lr_scaling": "linear", "adapt_batch": True,
        "adapt_interval": 3, "max_train_micro_batch_size_per_gpu": 4, "tuner_type": "gridsearch"}


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    """One tune and run: a 300 ms optimizer step (a costly step a larger accumulation count
    amortises) against 2 ms micro-steps, so goodput asks for a larger batch at any B_noise."""
    root = tmp_path_factory.mktemp("ramp")
    config = write_config(root / "ds.json", {**RAMP, "history": True, "storage": f"sqlite:///{root}/history.db"})
    result = tune(root, config, "--teacher", "--steps", "15", "--slow_optimizer_ms", "300", "--ms_per_micro_step", "2",
                  "--gas_log", root / "ran", mode="run", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


def rows(root):
    with open(root / "autotuning_results" / "batch_ramp.csv") as handle:
        return list(csv.DictReader(handle))


def test_every_rank_runs_the_batch_the_csv_says_from_the_step_after_each_change(ramped):
    root, _ = ramped
    ran = [json.loads((root / f"ran.{rank}.json").read_text()) for rank in (0, 1)]
    assert ran[0] == ran[1]  # the same gas and learning rate at every step on both ranks
    changes = rows(root)
    assert changes[0]["step"] == "0" and len(changes) >= 2, changes  # the start, and at least one change
    assert all(float(row["b_noise"]) > 0 for row in changes)  # the B_noise each was made at (the tune's at first)
    micro = int(changes[0]["global_batch"]) // (2 * int(changes[0]["gradient_accumulation_steps"]))
    for index, (gas, _lr) in enumerate(ran[0]):
        step = index + 1  # the optimizer step this entry ran
        applied = [row for row in changes if int(row["step"]) < step][-1]
        assert gas == int(applied["gradient_accumulation_steps"]), (step, changes)
        assert int(applied["global_batch"]) == micro * gas * 2
    for before, after in zip(changes, changes[1:]):
        assert int(after["step"]) % 3 == 0  # at the interval's boundaries only
        assert int(after["global_batch"]) > int(before["global_batch"])  # never smaller
        # the learning rate follows linearly (lr_scaling "linear"; the toy's config has no schedule)
        assert float(after["lr"]) / float(before["lr"]) == pytest.approx(
            int(after["global_batch"]) / int(before["global_batch"]), rel=1e-4)


def test_the_summary_and_the_optimal_config_carry_the_ramp(ramped):
    root, result = ramped
    assert "batch ramp: the training run reads B_noise and may grow gradient accumulation every 3 steps" in result.stdout
    first, last = rows(root)[0], rows(root)[-1]
    assert f"batch ramp: global batch {first['global_batch']} -> {last['global_batch']} (step " in result.stdout
    optimal = json.loads((root / "autotuning_results" / "ds_config_optimal.json").read_text())
    plan = json.loads((root / "autotuning_results" / "batch_ramp.json").read_text())
    assert optimal["autotuning"]["adapt_plan"] == str((root / "autotuning_results" / "batch_ramp.json").resolve())
    assert plan["interval"] == 3 and plan["reference_batch"] == 8 and plan["costs"]
    assert all(cost["step_s"] >= 0.25 for cost in plan["costs"])  # the 300 ms optimizer step, as the engine timed it


def ramp_config(out, interval: int = 3):
    """The optimal config of a goodput tune with adapt_batch, and its plan, written by hand."""
    from conftest import write_json

    out.mkdir(parents=True, exist_ok=True)
    plan = write_json(out / "batch_ramp.json", {
        "reference_batch": 8, "lr_scaling": "sqrt", "interval": interval, "max_global_batch": 64,
        "costs": [{"micro_batch_size": 2, "micro_step_s": 0.005, "step_s": 0.05}], "csv_path": str(out / "ramp.csv"),
        "initial_b_noise": 30.0})
    return write_json(out / "ds.json", {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "autotuning": {"adapt_batch": True, "adapt_interval": interval, "metric": "goodput", "reference_batch_size": 8,
                       "lr_scaling": "sqrt", "adapt_plan": str(plan)}})


def train(out, *flags):
    from conftest import WORKERS, run_launcher

    done = run_launcher("--nproc_per_node", "2", WORKERS / "ramp_train.py", "--out", out, *flags, "--deepspeed",
                        out / "ds.json", cwd=out, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads((out / f"ran.{rank}.json").read_text()) for rank in (0, 1)]


def test_a_run_resumed_mid_ramp_goes_on_at_the_same_batch_rate_and_losses(tmp_path):
    ramp_config(tmp_path / "whole")
    whole = train(tmp_path / "whole", "--steps", "12")
    assert [entry[:2] for entry in whole[0]] == [entry[:2] for entry in whole[1]]  # both ranks alike
    gas = [entry[0] for entry in whole[0]]
    assert gas[0] == 1 and max(gas) > 1, gas  # it grew (B_noise 30 against global batch 4)
    ramp_config(tmp_path / "split")
    train(tmp_path / "split", "--steps", "12", "--save_at", "7")  # after the ramp changed the batch
    resumed = train(tmp_path / "split", "--steps", "12", "--load")
    for rank in (0, 1):
        assert [entry[:2] for entry in resumed[rank]] == [entry[:2] for entry in whole[rank]]  # gas and rate
        assert [entry[2] for entry in resumed[rank]] == pytest.approx([entry[2] for entry in whole[rank]], abs=1e-6)


def test_the_runs_late_noise_scale_scores_the_next_tune_of_the_same_model(ramped):
    root, result = ramped
    late = json.loads((root / "autotuning_results" / "batch_ramp_last.json").read_text())
    assert late["b_noise"] > 0 and late["step"] == 15
    assert f"history: the training run's late B_noise {late['b_noise']:.1f} (step 15) kept in study" in result.stdout
    # Another tune of the same model (another run length: another study) scores goodput with it.
    again = tune(root, root / "ds.json", "--teacher", "--steps", "12", "--slow_optimizer_ms", "300",
                 "--ms_per_micro_step", "2", timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"goodput: B_noise {late['b_noise']:.1f}, read at step 15 of an earlier run's training" in again.stdout
