"""A pipeline's per-stage peak memory, measured and predicted, at 2 stages on 4 CPU ranks, under
1F1B, GPipe and Interleaved1F1B (2 virtual stages a rank) (issue 79).

    python benchmarks/pipeline_memory.py [--dim 256] [--blocks 8] [--seq 256] [--csv pipeline_memory.csv]

For each schedule, one real tune of tests/workers/pipe_gpt_train.py (a GPT-style PipelineModule
with a tied embedding and head, sequences long enough for activations to matter) at
`pipeline.stages` 2 (2 stages x 2 data parallel), ZeRO 0, a global batch of 32, micro-batches 1,
2, 4 and 8 (gridsearch): so gas runs 16 down to 2 and the micro-batches in flight differ by
schedule (1F1B holds up to 2 on stage 0, GPipe all of them, Interleaved1F1B the chunk forwards
of torch's warm-up). Each launch's row: the memory model's prediction before it (the heaviest stage's; tuning/memory/pipeline_stages.py), the measured peak (the
largest over the ranks: on a CPU each rank's resident-set high-water mark), the error, and each
stage's measured peak (the largest over its replicas). The profile launches are predicted by
nothing and are left out of the error. Memory is the point here: 4 ranks on 2 cores say
nothing about time. The load average at the start is printed with the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "tests" / "workers" / "pipe_gpt_train.py"


def tune(schedule: str, dim: int, blocks: int, seq: int, directory: Path) -> list[dict]:
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": [1, 2, 4, 8],
              "gradient_accumulation_steps": "auto",
              "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": 0}, "pipeline": {"stages": 2, "schedule": schedule},
              "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "exp_timeout_s": 300,
                             "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False, "fast": False,
                             "max_train_micro_batch_size_per_gpu": 8, "arg_mappings": {"pipeline.stages": "--pp"}}}
    (directory / "ds.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "4",
                           str(SCRIPT), "--steps", "40", "--dim", str(dim), "--blocks", str(blocks), "--seq", str(seq),
                           "--deepspeed", "ds.json"], cwd=directory, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {schedule} tune failed: {done.stderr[-2000:]}")
    rows = []
    with open(directory / "autotuning_results" / "experiments.csv") as table:
        for row in csv.DictReader(table):
            if row["state"] != "ok":
                continue
            metrics = json.loads((directory / "autotuning_exps" / row["name"] / "metrics.json").read_text())
            info_path = next((directory / "autotuning_exps").glob("*/model_info.json"))
            stage_of_rank = json.loads(info_path.read_text())["stage_of_rank"]
            peaks = metrics["peak_memory_bytes_per_rank"]
            by_stage = [max(p for p, s in zip(peaks, stage_of_rank) if s == k) / 2**20 for k in range(2)]
            predicted = float(row["predicted_memory_mib"]) if row["predicted_memory_mib"] else None
            measured = float(row["measured_memory_mib"])
            rows.append({"schedule": schedule, "name": row["name"], "micro_batch_size": row["micro_batch_size"],
                         "gas": row["gradient_accumulation_steps"],
                         "predicted_mib": predicted, "measured_mib": measured,
                         "error_pct": round(100 * (predicted - measured) / measured, 1) if predicted else None,
                         "stage0_mib": round(by_stage[0], 1), "stage1_mib": round(by_stage[1], 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--csv", default="pipeline_memory.csv")
    parser.add_argument("--schedules", default="1F1B,GPipe,Interleaved1F1B")
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f} (2 cores; 4 ranks)")
    rows = []
    for schedule in args.schedules.split(","):
        with tempfile.TemporaryDirectory() as directory:
            rows += tune(schedule, args.dim, args.blocks, args.seq, Path(directory))
    fields = list(rows[0])
    with open(RESULTS / args.csv, "w", newline="") as out:
        writer = csv.DictWriter(out, fields)
        writer.writeheader()
        writer.writerows(rows)
    print(" | ".join(fields))
    for row in rows:
        print(" | ".join(str(row[f]) for f in fields))
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    print(f"predicted launches: {len(errors)}, largest error {max(errors):.1f}%" if errors else "no predicted launch")


if __name__ == "__main__":
    main()
