"""Offload as a tuning dimension: a per-rank budget below what the model needs without offload.

`memory_per_rank_bytes` is set so that no stage fits gpt2-medium's states on the GPU; the tuner
must then search ZeRO 2/3 with CPU offload (FSDP2 CPUOffloadPolicy) instead of failing.

    python benchmarks/gpu/offload_demo.py --budget_gib 5 --out_dir $OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, SCRIPT, gpt2_config, script_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2-medium")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--budget_gib", type=float, default=5.0)
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_offload"))
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(work, start_step=3, end_step=6, overwrite=True, fast=False,
                         memory_per_rank_bytes=int(args.budget_gib * 2**30),
                         max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=2)
    # Knobs fixed: the demo is about offload, not about the full-mode knob search.
    config["zero_optimization"] = {"stage": "all", "overlap_comm": True, "stage3_param_persistence_threshold": 0,
                                   "reduce_bucket_size": 50_000_000, "contiguous_gradients": False}
    config_file = work / "ds.json"
    config_file.write_text(json.dumps(config))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "1", str(SCRIPT),
               *script_args(args.preset, args.seq_len, work, config_file)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(result.stdout)
    print(result.stderr[-5000:], file=sys.stderr)
    print(f"exit {result.returncode}; wall {time.monotonic() - started:.0f} s")
    (args.out_dir / "offload_demo.log").write_text(
        f"$ {' '.join(command)}\n{result.stdout}\n--- stderr (tail) ---\n{result.stderr[-5000:]}\n"
        f"exit {result.returncode}; wall {time.monotonic() - started:.0f} s\n")
    if (work / "results" / "experiments.csv").exists():
        shutil.copy(work / "results" / "experiments.csv", args.out_dir / "offload_experiments.csv")


if __name__ == "__main__":
    main()
