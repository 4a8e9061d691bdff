"""An unchanged DeepSpeed script tuned on DeepSpeed's own engine on CUDA (issue 16's GPU checks).
Skipped where there is no CUDA device or no DeepSpeed, as in CI."""

import importlib.util
import json
import shlex
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT, experiments_table, launcher_env, run_launcher, write_json

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed"),
]

DS_EXAMPLE = ROOT / "examples" / "deepspeed" / "train.py"
MODEL = ("--width", "2048", "--depth", "8")


def write_ds_config(tmp_path, autotuning: dict, **top):
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": "all"},
        **top,
        "autotuning": {"enabled": True, "fast": True, "exp_timeout_s": 300, "results_dir": str(tmp_path / "results"),
                       "exps_dir": str(tmp_path / "exps"), **autotuning},
    }
    return write_json(tmp_path / "ds.json", config)


def test_an_unchanged_deepspeed_script_tunes_and_trains_on_deepspeed_on_cuda(tmp_path, no_orphans):
    config = write_ds_config(tmp_path, {"max_train_batch_size": 256, "max_train_micro_batch_size_per_gpu": 128},
                          bf16={"enabled": True})
    result = run_launcher("--autotuning", "run", "--nproc_per_node", "1", DS_EXAMPLE, *MODEL, "--steps", "20",
                          "--deepspeed", "--deepspeed_config", config, timeout=850)
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done on deepspeed.runtime.engine.DeepSpeedEngine: 20 steps" in result.stdout
    table = experiments_table(tmp_path / "results")
    measured = table[table.state == "ok"]
    assert len(measured) >= 3 and set(measured.engine) == {"deepspeed"}
    for metrics_file in (tmp_path / "exps").glob("*/metrics.json"):
        metrics = json.loads(metrics_file.read_text())
        assert metrics["engine"] == "deepspeed" and metrics["device_type"] == "cuda"
        assert metrics["precision"] == "bf16"
        assert 0 < metrics["peak_memory_bytes"] <= metrics["peak_reserved_bytes"]
        assert metrics["forward"]["count"] > 0 and metrics["step"]["count"] > 0
    infos = [json.loads(p.read_text()) for p in (tmp_path / "exps").glob("*/model_info.json")]
    assert infos and all(info["engine"] == "deepspeed" and info["device_memory_bytes"] for info in infos)
    assert infos[0]["num_params"] > 30_000_000
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "Engine: DeepSpeed's own" in summary and "Memory model, predicted before each launch" in summary
    print(table[["name", "phase", "state", "engine", "throughput_samples_s", "predicted_memory_mib",
                 "measured_memory_mib", "memory_error_pct"]].to_string())
    # The optimum trains under DeepSpeed's own launcher too, as written to cmd_optimal_deepspeed.txt.
    command = shlex.split((tmp_path / "results" / "cmd_optimal_deepspeed.txt").read_text())
    # env OMP_NUM_THREADS=N (the experiments'), DeepSpeed's launcher, then the GPUs: --num_gpus, or
    # --include where CUDA_VISIBLE_DEVICES chose them.
    at = next(i for i, word in enumerate(command) if word.endswith("deepspeed"))
    assert command[0] == "env" and command[1].startswith("OMP_NUM_THREADS=")
    assert command[at + 1] in ("--num_gpus", "--include"), command
    if shutil.which("deepspeed"):
        done = subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "done on deepspeed.runtime.engine.DeepSpeedEngine" in done.stdout


def test_offload_is_searched_in_full_mode_on_deepspeed_on_cuda(tmp_path, no_orphans):
    """ZeRO 2 with its bucket knobs fixed by the user: full mode sweeps offload_optimizer alone."""
    config = write_ds_config(tmp_path, {"fast": False, "tuner_type": "gridsearch", "remeasure_rounds": 0},
                          train_micro_batch_size_per_gpu=[16], gradient_accumulation_steps=1,
                          zero_optimization={"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                             "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000})
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "1", DS_EXAMPLE, *MODEL,
                          "--deepspeed", "--deepspeed_config", config, timeout=850)
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = experiments_table(tmp_path / "results").fillna("")
    print(table[["name", "state", "engine", "knobs", "throughput_samples_s", "predicted_memory_mib",
                 "measured_memory_mib"]].to_string())
    offloaded = table[table.knobs.str.contains("offload_optimizer=cpu")]
    kept = table[table.knobs.str.contains("offload_optimizer=none")]
    assert len(offloaded) == 1 and len(kept) == 1
    assert offloaded.iloc[0].state == "ok" and offloaded.iloc[0].engine == "deepspeed"
    # The fp32 master weights, Adam's states and fp32 gradients left the GPU.
    assert offloaded.iloc[0].measured_memory_mib < kept.iloc[0].measured_memory_mib
