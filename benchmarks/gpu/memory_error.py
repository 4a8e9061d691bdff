"""Memory-model error on one GPU: the tuner's predicted peak against the measured one.

For a GPT-2 preset, run the tuner's own profile launches, then one launch per ZeRO stage and
micro-batch through the tuner's experiment runner, and table the raw prediction (no correction
from earlier launches) against `torch.cuda.max_memory_allocated` and `max_memory_reserved`.

    python benchmarks/gpu/memory_error.py --preset gpt2 --micro 1 4 8 --csv out.csv
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import asdict
from pathlib import Path

from common import gpt2_config, script_args, settings_for

from autotuner.config import load_config
from autotuner.tuning.autotuner import Autotuner
from autotuner.tuning.memory import estimate
from autotuner.tuning.space import Experiment

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_memory"))
    parser.add_argument("--csv", type=Path, required=True)
    args = parser.parse_args()
    work = (args.work_dir / args.preset).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(work, start_step=3, end_step=6, overwrite=True)
    config_file = work / "ds.json"
    config_file.write_text(json.dumps(config))
    settings = settings_for(config, script_args(args.preset, args.seq_len, work, config_file), 3, 6)
    tuner = Autotuner(load_config(config), settings, work / "results", work / "exps",
                      report=lambda line: print(f"[{args.preset}] {line}", flush=True))
    tuner._prepare_dirs()
    tuner._measure_model()
    rows = []
    for stage in args.stages:
        for micro in args.micro:
            experiment = Experiment(stage, micro, 1)
            result = tuner._evaluate(experiment)
            parts = estimate(tuner.memory.profile, tuner.memory.stage_settings(stage), micro)
            metrics = result.metrics or {}
            measured, reserved = metrics.get("peak_memory_bytes"), metrics.get("peak_reserved_bytes")
            predicted = result.predicted_memory_bytes
            rows.append({
                "preset": args.preset, "num_params": tuner.memory.profile.num_params, "seq_len": args.seq_len,
                "precision": tuner.memory.precision, "zero_stage": stage, "micro_batch_size": micro,
                "state": result.state.value, "predicted_mib": round(predicted / MiB, 1),
                "allocated_mib": round(measured / MiB, 1) if measured else None,
                "reserved_mib": round(reserved / MiB, 1) if reserved else None,
                "error_vs_allocated_pct": round(100 * (predicted - measured) / measured, 1) if measured else None,
                "error_vs_reserved_pct": round(100 * (predicted - reserved) / reserved, 1) if reserved else None,
                **{f"model_{k}_mib": round(v / MiB, 1) for k, v in asdict(parts).items()},
            })
            print(json.dumps(rows[-1]), flush=True)
    new_file = not args.csv.exists()
    with args.csv.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        if new_file:
            writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
