"""Shared set-up of the GPU benchmarks: the GPT-2 example as the tuner launches it, measured through
the tuner's public measuring API (autotuner.app.measure), as the tuner measures its own launches."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autotuner.app.measure import ExperimentSettings, measurement_settings  # noqa: E402

SCRIPT = ROOT / "examples" / "hf_gpt2" / "train.py"
ARG_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def gpt2_config(work_dir: Path, *, start_step: int = 3, end_step: int = 8, precision: str = "bf16",
                **autotuning: Any) -> dict[str, Any]:
    """The example's DeepSpeed config in bf16 (fp32: a CPU dry run) with gas 1, every stage, micro-batch searched."""
    config = json.loads((ROOT / "examples" / "hf_gpt2" / "ds_config.json").read_text())
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config["gradient_accumulation_steps"] = 1
    config["train_micro_batch_size_per_gpu"] = "auto"
    config["autotuning"] = {
        "enabled": True, "fast": True, "metric": "throughput", "start_profile_step": start_step,
        "end_profile_step": end_step, "exp_timeout_s": 600, "arg_mappings": dict(ARG_MAPPINGS),
        "results_dir": str(work_dir / "results"), "exps_dir": str(work_dir / "exps"), **autotuning,
    }
    return config


def script_args(preset: str, seq_len: int, work_dir: Path, config_file: Path) -> tuple[str, ...]:
    # One data cache for every launch: the BPE tokenizer is trained once.
    return ("--model_size", preset, "--seq_len", str(seq_len), "--max_steps", "1000",
            "--output_dir", str(work_dir.parent / "data"), "--deepspeed", str(config_file))


def settings_for(config: dict[str, Any], args: tuple[str, ...], start_step: int, end_step: int,
                 nproc_per_node: int = 1) -> ExperimentSettings:
    return measurement_settings(SCRIPT, args, config, nproc_per_node=nproc_per_node, start_profile_step=start_step,
                                end_profile_step=end_step, arg_mappings=ARG_MAPPINGS, timeout_s=600)


MATMUL = """
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); start = time.perf_counter()
for _ in range(20): a @ b
torch.cuda.synchronize(); print(20 * 2 * 8192**3 / (time.perf_counter() - start))
"""


def matmul_flops(env: dict | None = None) -> float:
    """bf16 8192^3 matrix products per second, in a child so this process never holds a CUDA context
    (NaN without a GPU: then no MFU)."""
    import subprocess

    child = subprocess.run([sys.executable, "-c", MATMUL], capture_output=True, text=True, env=env)
    return float(child.stdout) if child.returncode == 0 else float("nan")


def flops_per_token(preset: str, seq_len: int) -> float:
    """6 x parameters + 12 x layers x width x sequence (attention), the model built on the meta device."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, str(ROOT / "examples" / "hf_gpt2"))
    from train import PRESETS

    layers, width, heads, vocab = PRESETS[preset]
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                           n_positions=max(seq_len, 1024), vocab_size=max(vocab, 4096)))
    return 6 * sum(p.numel() for p in model.parameters()) + 12 * layers * width * seq_len
