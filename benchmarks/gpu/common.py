"""Shared set-up of the GPU benchmarks: the GPT-2 example as the tuner launches it, and an interleaved
re-measurement harness. Both go through the tuner's own experiment runner (autotuner.tuning.experiment)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autotuner.config import load_config  # noqa: E402
from autotuner.tuning.config_space import base_config  # noqa: E402
from autotuner.tuning.experiment import ExperimentSettings  # noqa: E402
from autotuner.tuning.records import Objective  # noqa: E402

SCRIPT = ROOT / "examples" / "hf_gpt2" / "train.py"
ARG_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def gpt2_config(work_dir: Path, *, start_step: int = 3, end_step: int = 8, **autotuning: Any) -> dict[str, Any]:
    """The example's DeepSpeed config in bf16 with gas 1, every stage, micro-batch searched."""
    config = json.loads((ROOT / "examples" / "hf_gpt2" / "ds_config.json").read_text())
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


def settings_for(config: dict[str, Any], args: tuple[str, ...], start_step: int, end_step: int) -> ExperimentSettings:
    loaded = load_config(copy.deepcopy(config))
    return ExperimentSettings(script=str(SCRIPT), script_args=args, base_config=base_config(loaded),
                              nproc_per_node=1, data_parallel_size=1, objective=Objective("throughput"),
                              timeout_s=600, start_profile_step=start_step, end_profile_step=end_step,
                              arg_mappings=dict(ARG_MAPPINGS))
