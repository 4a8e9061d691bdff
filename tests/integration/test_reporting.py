"""The DeepSpeed config sections a run reports through, honoured on our engine: tensorboard,
csv_monitor and wandb (read back with their own readers), flops_profiler, wall_clock_breakdown,
engine.tput_timer / engine.monitor / save_16bit_model, and how gradients are reduced
(communication_data_type, prescale_gradients, gradient_predivide_factor)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from conftest import WORKERS, run_launcher

TRAIN = WORKERS / "reporting_train.py"
MACS = 4 * (8 * 32 + 2 * (32 * 64 + 64 * 32) + 32)  # micro-batch 4 through reporting_train.Net's Linears


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage}, **extra}


def train(tmp_path, name: str, cfg: dict, *args: str, steps: int = 4) -> tuple[dict, str]:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "ds.json").write_text(json.dumps(cfg))
    result = run_launcher("--nproc_per_node", "2", TRAIN, "--steps", str(steps), "--out", folder / "r.json", *args,
                          "--deepspeed", folder / "ds.json", cwd=folder, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "r.json").read_text()), result.stdout


@pytest.mark.slow
def test_monitors_write_deepspeeds_events_that_their_own_readers_load(tmp_path, no_orphans, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: wandb writes its run to ./wandb
    cfg = config(2, wall_clock_breakdown=True,
                 tensorboard={"enabled": True, "output_path": "tb", "job_name": "job"},
                 csv_monitor={"enabled": True, "output_path": "csv", "job_name": "job"},
                 wandb={"enabled": True, "project": "proj"},
                 flops_profiler={"enabled": True, "profile_step": 2, "module_depth": 2, "output_file": "flops.txt"})
    run, stdout = train(tmp_path, "z2", cfg, "--custom_event")
    folder = tmp_path / "z2"
    batch = run["train_batch_size"]
    assert batch == 4 * 2 * 2 and run["global_samples"] == 4 * batch
    events = EventAccumulator(str(folder / "tb" / "job"))
    events.Reload()
    names = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/elapsed_time_ms_forward",
             "Train/Samples/elapsed_time_ms_backward", "Train/Samples/elapsed_time_ms_step", "Custom/step_loss"}
    assert names <= set(events.Tags()["scalars"])
    # One point per optimizer step, at the samples trained so far, from rank 0 alone.
    assert [e.step for e in events.Scalars("Train/Samples/lr")] == [batch, 2 * batch, 3 * batch, 4 * batch]
    assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx([0.01] * 4)
    # train_loss is the mean loss of the accumulation window, on rank 0.
    window_means = [(a + b) / 2 for a, b in zip(run["losses"][::2], run["losses"][1::2])]
    assert [e.value for e in events.Scalars("Train/Samples/train_loss")] == pytest.approx(window_means, rel=1e-5)
    assert len(list((folder / "tb").rglob("events.out.tfevents.*"))) == 1
    with open(folder / "csv" / "job" / "Train_Samples_train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [batch * i for i in (1, 2, 3, 4)]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(window_means, rel=1e-5)
    summary = run["wandb_summary"]
    assert summary["Train/Samples/train_loss"] == pytest.approx(window_means[-1], rel=1e-5)
    assert summary["Custom/step_loss"] == pytest.approx(run["losses"][-1], rel=1e-5)
    assert len(list((folder / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    # wall_clock_breakdown: DeepSpeed's lines from rank 0, and the engine's timers.
    assert stdout.count("[Rank 0] time (ms) | fwd: ") == 4 and stdout.count("fwd_microstep: ") == 8
    assert set(run["timers"]) == {"fwd_microstep", "bwd_microstep", "step_microstep", "fwd", "bwd", "step"}
    assert "[Rank 0] step=2, skipped=0, lr=[0.01]" in stdout and "[Rank 1]" not in stdout
    # tput_timer: DeepSpeed's line every steps_per_print steps and a running average after warm-up.
    assert "global_step=4, RunningAvgSamplesPerSec=" in stdout and run["avg_samples_per_sec"] > 0
    # flops_profiler, to its output_file: FLOPs counted by torch equal the model's multiply-adds.
    profile = (folder / "flops.txt").read_text()
    assert "Profile Summary at step 3:" in profile and "Aggregated Profile per GPU" in profile
    macs_line = next(line for line in profile.splitlines() if line.startswith("fwd MACs per GPU:"))
    assert macs_line.split()[-1] == f"{MACS / 1e3:g}KMACs" or macs_line.split()[-2:] == [f"{MACS / 1e3:g}", "KMACs"]
    assert "bwd latency:" in profile and "samples/second:" in profile and "(blocks): ModuleList" in profile


@pytest.mark.slow
def test_save_16bit_model_gathers_the_whole_model_in_training_precision(tmp_path, no_orphans):
    cfg = config(3, bf16={"enabled": True}, zero_optimization={"stage": 3,
                                                              "stage3_gather_16bit_weights_on_model_save": True})
    run, _ = train(tmp_path, "z3", cfg, "--save16", "saved", steps=2)
    assert run["saved"] is True
    state = torch.load(tmp_path / "z3" / "saved" / "pytorch_model.bin")
    assert set(state) == set(run["weights"])
    for name, values in run["weights"].items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], torch.tensor(values).bfloat16())  # the fp32 master weights, rounded
    # At stage 3 without the gather key, DeepSpeed saves nothing and returns False; so do we.
    run, _ = train(tmp_path, "z3_no_gather", config(3), "--save16", "saved", steps=1)
    assert run["saved"] is False and not (tmp_path / "z3_no_gather" / "saved").exists()


def _max_difference(a: dict, b: dict) -> float:
    return max(abs(x - y) for name in a for x, y in zip(torch.tensor(a[name]).flatten().tolist(),
                                                        torch.tensor(b[name]).flatten().tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_communication_data_type_bf16_reduces_in_bf16(tmp_path, no_orphans, stage):
    sgd = {"type": "SGD", "params": {"lr": 0.01}}  # the update is lr x gradient: weights show the reduction's error
    exact, _ = train(tmp_path, "fp32", config(stage, optimizer=sgd), steps=3)
    low, _ = train(tmp_path, "bf16", config(stage, optimizer=sgd, communication_data_type="bf16"), steps=3)
    difference = _max_difference(exact["weights"], low["weights"])
    # bf16 keeps 8 bits of mantissa: the reduced gradients differ a little, and only a little.
    assert 0 < difference < 1e-3, difference


@pytest.mark.slow
def test_prescale_and_predivide_are_deepspeeds_fp16_overflow_guards(tmp_path, no_orphans):
    """Gradients near fp16's limit: summing two ranks' overflows unless divided first, which is
    what prescale_gradients (by the world size) and gradient_predivide_factor do in DeepSpeed."""
    big = ("--gradient_offset", "40000")  # each rank's 40000 fits fp16; their sum, 80000, does not
    plain, _ = train(tmp_path, "sum_first", config(0, communication_data_type="fp16"), *big, steps=1)
    prescaled, _ = train(tmp_path, "prescale", config(0, communication_data_type="fp16", prescale_gradients=True),
                         *big, steps=1)
    predivided, _ = train(tmp_path, "predivide", config(0, communication_data_type="fp16",
                                                        gradient_predivide_factor=2.0), *big, steps=1)
    reference, _ = train(tmp_path, "fp32", config(0), *big, steps=1)

    def finite(run: dict) -> bool:
        return all(math.isfinite(v) for values in run["weights"].values() for v in torch.tensor(values).flatten())

    assert not finite(plain)
    assert finite(prescaled) and finite(predivided)
    assert _max_difference(prescaled["weights"], reference["weights"]) < 1e-3
    assert _max_difference(predivided["weights"], reference["weights"]) < 1e-3


@pytest.mark.slow
def test_tuning_experiments_leave_the_users_curves_alone_and_the_tuned_run_writes_them(tmp_path, no_orphans):
    pytest.importorskip("tensorboard")
    cfg = config(0, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=1,
                 zero_optimization={"stage": [0, 2]},
                 tensorboard={"enabled": True, "output_path": "tb", "job_name": "job"},
                 autotuning={"enabled": True, "max_train_micro_batch_size_per_gpu": 4, "start_profile_step": 2,
                             "end_profile_step": 3})
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    command = ("--nproc_per_node", "2", TRAIN, "--steps", "4", "--out", tmp_path / "r.json", "--deepspeed",
               tmp_path / "ds.json")
    # One `run`: its experiments, in this folder, then the pick's training. Each process that writes
    # events writes a file of its own: a dozen three-step runs mixed into the job's curves would show
    # as more than one file, and no tensorboard folder of its own shows under any experiment's.
    trained = run_launcher("--autotuning", "run", *command, cwd=tmp_path, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "autotuning_results" / "experiments.csv").exists()
    assert "training with the optimal config" in trained.stdout
    assert not list((tmp_path / "autotuning_exps").rglob("events.out.tfevents.*"))
    assert len(list((tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1
    assert len(list((tmp_path / "tb" / "job").glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("section, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_monitor_whose_package_is_missing_is_refused_in_one_line(monkeypatch, tmp_path, section, module):
    from autotuner.config.loader import load_config
    from autotuner.core.errors import UnsupportedError
    from autotuner.monitor.monitor import MonitorMaster

    monkeypatch.setitem(__import__("sys").modules, module, None)  # as if not installed: import raises
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedError, match=f"{section}.enabled is true, but the .* package is not installed; "
                                               r"pip install 'autotuner\[monitor\]'"):
        MonitorMaster(load_config({section: {"enabled": True}}))
