"""The engine on CUDA (nccl, one GPU). Skipped where there is no CUDA device, as in CI."""

import json

import pytest
import torch

from conftest import CONFIGS, MINIMAL, WORKERS, run_launcher
from autotuner.config import read_config_file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run_check(check: str, tmp_path) -> dict:
    out = tmp_path / f"{check}.json"
    result = run_launcher("--nproc_per_node", "1", WORKERS / "engine_checks.py", "--check", check, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_stage_gives_stage0_losses_on_cuda(tmp_path):
    losses = run_check("parity", tmp_path)["losses"]
    for stage in ("1", "2", "3"):
        assert losses[stage] == pytest.approx(losses["0"], abs=1e-5), f"stage {stage}"


def test_bf16_trains_under_every_stage_on_cuda(tmp_path):
    losses = run_check("bf16", tmp_path)["losses"]
    for stage, values in losses.items():
        assert all(v == v for v in values), f"stage {stage} gave NaN"


def test_metrics_on_cuda_report_allocator_peak(tmp_path):
    metric_path = tmp_path / "metrics.json"
    config = read_config_file(CONFIGS / "zero3.json")
    config["autotuning"] = {"enabled": True, "start_profile_step": 3, "end_profile_step": 6,
                            "metric_path": str(metric_path)}
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--nproc_per_node", "1", MINIMAL, "--deepspeed", config_file, "--steps", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(metric_path.read_text())
    assert metrics["device_type"] == "cuda" and metrics["world_size"] == 1
    assert 0 < metrics["peak_memory_bytes"] < torch.cuda.get_device_properties(0).total_memory
    print("GPU peak memory (bytes):", metrics["peak_memory_bytes"])
