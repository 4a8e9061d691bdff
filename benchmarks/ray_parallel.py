"""Experiments in parallel on a Ray cluster against the same sweep one at a time.

    python benchmarks/ray_parallel.py [--rounds 3] [--width 512 --depth 4] [--micro 4,8,16,32,64]
                                      [--tuner_type gridsearch|predictive]

A two-node Ray cluster is started on this machine (ray.cluster_utils.Cluster, one CPU per node).
The same sweep, grid search by default or `--tuner_type predictive` (the default tuner, which
then asks its most optimistic candidates at once) (benchmarks/workloads/dual_engine.py on our engine, 1 rank per
experiment, ZeRO 0 and 1 x --micro, model_info given so there is no profile launch, no final
re-measure) is tuned with `--backend ray` three ways, interleaved for --rounds rounds:
- parallel: the default, exclusive nodes, so 2 experiments at once;
- sequential: `--ray_max_concurrent 1`, the same cluster one experiment at a time;
- sequential_again: the same as sequential, run as an A/A control of the noise.
Per run: tuning wall time, launches, and the pick. Reported: medians, spreads, and the ratio
of parallel to sequential medians (and of the A/A pair). On this 2-core machine the two
simulated nodes share the cores' memory bandwidth, so each parallel experiment runs somewhat
slower than alone; on a real cluster each node has its own.
Results: benchmarks/results/ray_parallel.csv and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "workloads" / "dual_engine.py"
RESULTS = ROOT / "benchmarks" / "results" / "ray_parallel.csv"
MODES = {"parallel": (), "sequential": ("--ray_max_concurrent", "1"),
         "sequential_again": ("--ray_max_concurrent", "1")}


def log(line: str) -> None:
    print(f"[ray_parallel {time.strftime('%H:%M:%S')}] {line}", flush=True)


def config(args, work: Path) -> Path:
    path = work / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": [int(m) for m in args.micro.split(",")],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0, 1]},
        "autotuning": {"enabled": True, "fast": True, "overwrite": True, "tuner_type": args.tuner_type,
                       "tuner_early_stopping": 100, "remeasure_rounds": 0, "start_profile_step": 3,
                       "end_profile_step": 6, "model_info": {"num_params": args.width * args.width * args.depth}},
    }))
    return path


def tune(args, address: str, mode: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--backend", "ray", "--ray_address",
               address, "--nproc_per_node", "1", *MODES[mode], str(SCRIPT), "--engine", "autotuner", "--width",
               str(args.width), "--depth", str(args.depth), "--steps", "50", "--deepspeed", "--deepspeed_config",
               str(config(args, work))]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    started = time.monotonic()
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - started
    (work / "tune.log").write_text(result.stdout + result.stderr)
    table = pd.read_csv(work / "autotuning_results" / "experiments.csv")
    launched = table[table.state != "pruned"]
    chosen = table[table.chosen].name.tolist()
    return {"mode": mode, "exit_status": result.returncode, "wall_s": round(wall, 1), "launches": len(launched),
            "failed": int((launched.state != "ok").sum()), "pick": chosen[0] if chosen else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--micro", default="4,8,16,32,64")
    parser.add_argument("--tuner_type", default="gridsearch", choices=("gridsearch", "predictive", "random"))
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    log(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2**20,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="ray-parallel-") as scratch:
            for round_index in range(args.rounds):
                for mode in MODES:
                    row = tune(args, cluster.address, mode, Path(scratch) / f"{mode}{round_index}")
                    row["round"] = round_index + 1
                    log(json.dumps(row))
                    rows.append(row)
    finally:
        cluster.shutdown()
    table = pd.DataFrame(rows)
    load = os.getloadavg()[0]
    table["workload"] = f"mlp w{args.width} d{args.depth}, z0-1 x micro {args.micro}, 1 rank, 2 nodes x 1 CPU"
    table["date"] = time.strftime("%Y-%m-%d")
    table["load_avg_end"] = round(load, 2)
    table["tuner_type"] = args.tuner_type
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():  # keep the other tuners' rows (rows from before the column: gridsearch)
        old = pd.read_csv(RESULTS)
        old["tuner_type"] = old["tuner_type"].fillna("gridsearch") if "tuner_type" in old else "gridsearch"
        pd.concat([old[old.tuner_type != args.tuner_type], table], ignore_index=True).to_csv(RESULTS, index=False)
    else:
        table.to_csv(RESULTS, index=False)
    print(table.to_markdown(index=False))
    medians = {mode: statistics.median(table[table["mode"] == mode].wall_s) for mode in MODES}
    spread = {mode: (table[table["mode"] == mode].wall_s.min(), table[table["mode"] == mode].wall_s.max())
              for mode in MODES}
    for mode in MODES:
        print(f"{mode}: median {medians[mode]:.1f} s (range {spread[mode][0]:.1f}-{spread[mode][1]:.1f})")
    print(f"parallel / sequential: {medians['parallel'] / medians['sequential']:.3f}; A/A control "
          f"sequential_again / sequential: {medians['sequential_again'] / medians['sequential']:.3f}")
    print(f"picks: {sorted(set(table.pick.dropna()))}")


if __name__ == "__main__":
    main()
