"""The global batch grown through training (issue 70), with real processes: a goodput tune with
autotuning.adapt_batch, then its pick's training run (`--autotuning run`) reading B_noise and
growing gradient accumulation at the interval's boundaries, on every rank at the same step, the
learning rate following; each change a row of batch_ramp.csv, and the run's summary the ramp."""

from __future__ import annotations

import csv
import importlib.util
import json
import re

import pytest

from conftest import launcher_env, tune, write_config

pytestmark = pytest.mark.slow

RAMP = {"metric": "goodput", "reference_batch_size": 8, "lr_scaling": "linear", "adapt_batch": True,
        "adapt_interval": 3, "max_train_micro_batch_size_per_gpu": 4, "tuner_type": "gridsearch"}
BUDGET = 512 << 20  # memory_per_rank_bytes: the tune's launches and the ramped run's ranks under it


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    """One tune and run: a 300 ms optimizer step (a costly step a larger accumulation count
    amortises) against 2 ms micro-steps, so goodput asks for a larger batch at any B_noise; each
    micro-step holds 4 MiB a sample until its backward is done, as activations are held. glibc
    returns those blocks at once (MALLOC_MMAP_THRESHOLD_, as the launcher advises under a CPU
    budget), so a rank's peak resident set shows what it held at once, not what the heap kept."""
    root = tmp_path_factory.mktemp("ramp")
    config = write_config(root / "ds.json", {**RAMP, "history": True, "storage": f"sqlite:///{root}/history.db",
                                             "memory_per_rank_bytes": BUDGET})
    result = tune(root, config, "--teacher", "--steps", "15", "--slow_optimizer_ms", "300", "--ms_per_micro_step", "2",
                  "--mem_per_sample_mb", "4",
                  "--gas_log", root / "ran", "--peak_log", root / "peak", "--peak_to", root / "peaks.txt", mode="run",
                  env={**launcher_env(), "MALLOC_MMAP_THRESHOLD_": "131072"}, timeout=600)
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


def test_the_ramped_run_stays_within_the_memory_budget_and_its_ranks_hold_no_more_after_a_change(ramped):
    """Only gradient accumulation grows: a rank holds one micro-batch's activations and one set of
    gradients whatever the count, so its peak after the batch grew is the peak before (a second
    micro-batch held at once would add 16 MiB), and the run's peak is under the tune's budget."""
    root, _ = ramped
    changes = rows(root)
    first = int(changes[1]["step"])  # the larger count runs from the step after this one
    for rank in (0, 1):
        peaks = json.loads((root / f"peak.{rank}.json").read_text())
        assert peaks[-1] <= peaks[first - 1] + 4 * 2**20, (rank, first, peaks)
        assert peaks[-1] <= BUDGET
    ends = [int(line.split()[1]) for line in (root / "peaks.txt").read_text().splitlines()]
    assert len(ends) == 2, ends  # the run's two ranks wrote at its end (a tuner's launch leaves at its window's)


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
    """The optimal config of a goodput tune with adapt_batch, and its plan, written by hand: at
    micro-batch 4 a micro-step costs hardly more than at 2, so the ramp grows the micro-batch where
    it may (the engine's own loader), and gas otherwise."""
    from conftest import write_json

    out.mkdir(parents=True, exist_ok=True)
    plan = write_json(out / "batch_ramp.json", {
        "reference_batch": 8, "lr_scaling": "sqrt", "interval": interval, "max_global_batch": 64,
        "costs": [{"micro_batch_size": 2, "micro_step_s": 0.005, "step_s": 0.05},
                  {"micro_batch_size": 4, "micro_step_s": 0.006, "step_s": 0.05}],
        "csv_path": str(out / "ramp.csv"), "initial_b_noise": 30.0})
    return write_json(out / "ds.json", {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "autotuning": {"adapt_batch": True, "adapt_interval": interval, "metric": "goodput", "reference_batch_size": 8,
                       "lr_scaling": "sqrt", "adapt_plan": str(plan)}})


def train(out, *flags):
    from conftest import WORKERS, run_launcher

    # DeepSpeed's own flags: --deepspeed is a switch there, the file comes with --deepspeed_config.
    config = ("--deepspeed", "--deepspeed_config") if "--use_deepspeed" in flags else ("--deepspeed",)
    done = run_launcher("--nproc_per_node", "2", WORKERS / "ramp_train.py", "--out", out, *flags, *config,
                        out / "ds.json", cwd=out, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads((out / f"ran.{rank}.json").read_text()) for rank in (0, 1)]


ENGINES = [pytest.param((), id="ours"), pytest.param(("--engine_loader",), id="ours-engine-loader"),
           pytest.param(("--use_deepspeed",), id="deepspeed")]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_resumed_mid_ramp_goes_on_at_the_same_batch_rate_and_losses(tmp_path, engine):
    if engine and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed: pip install 'autotuner[deepspeed]'")
    # The whole run saves a checkpoint after step 7 (after the ramp changed the batch) and trains on;
    # a new launch resumes from it in the same directory.
    ramp_config(tmp_path / "whole")
    whole = train(tmp_path / "whole", "--steps", "12", "--save_at", "7", *engine)
    assert [entry[:2] for entry in whole[0]] == [entry[:2] for entry in whole[1]]  # both ranks alike
    gas, micro = [entry[0] for entry in whole[0]], [entry[3] for entry in whole[0]]
    batches = [entry[0] * entry[3] for entry in whole[0]]
    assert batches[0] == 2 and max(batches) > 2, whole[0]  # it grew (B_noise 30 against global batch 4)
    if engine == ("--engine_loader",):
        assert max(micro) == 4, whole[0]  # the micro-batch grew, the loader's batches with it
    else:
        assert set(micro) == {2} and max(gas) > 1, whole[0]  # a loader of the script's own: gas only
    assert all(entry[4] == [entry[3]] for entry in whole[0]), whole[0]  # every batch the engine's size
    resumed = train(tmp_path / "whole", "--steps", "12", "--load", *engine)
    for rank in (0, 1):
        assert [entry[:2] + entry[3:] for entry in resumed[rank]] == [entry[:2] + entry[3:] for entry in whole[rank]]
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


def test_on_deepspeeds_engine_the_profile_reads_the_noise_and_the_run_ramps_through_its_own_calls(tmp_path):
    """The same tune and run with the toy script on DeepSpeed's engine (ZeRO 0): the profile reads
    B_noise around DeepSpeed's boundary all-reduce, and the training run grows gas with DeepSpeed's
    set_train_batch_size, every rank at the same step, each step the whole count."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed: pip install 'autotuner[deepspeed]'")
    config = write_config(tmp_path / "ds.json", RAMP)
    result = tune(tmp_path, config, "--teacher", "--steps", "15", "--slow_optimizer_ms", "300",
                  "--ms_per_micro_step", "2", "--gas_log", tmp_path / "ran", "--use_deepspeed", mode="run", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"B_noise [\d.]+ \+/- [\d.]+ samples \(\d+ profile steps\)", result.stdout), \
        result.stdout[-3000:]  # read in the profile, on DeepSpeed's engine
    ran = [json.loads((tmp_path / f"ran.{rank}.json").read_text()) for rank in (0, 1)]
    assert ran[0] == ran[1]
    changes = rows(tmp_path)
    assert len(changes) >= 2, changes
    for index, (gas, _lr) in enumerate(ran[0]):
        applied = [row for row in changes if int(row["step"]) < index + 1][-1]
        assert gas == int(applied["gradient_accumulation_steps"]), (index + 1, changes)
    assert f"batch ramp: global batch {changes[0]['global_batch']} -> {changes[-1]['global_batch']}" in result.stdout
