"""Online tuning against default knobs, on a communication-heavy CPU workload under DDP.

    python benchmarks/online_tuning.py [--rounds 5] [--tune_steps 800] [--steps 80]

1. One `launcher --autotuning online` run of benchmarks/workloads/wide_mlp.py (64 layers of
   256x256, micro-batch 4, ZeRO 0, 2 CPU ranks) tunes bucket_cap_mb and gradient_as_bucket_view
   and writes best_knobs.json.
2. Then three arms are launched as plain training runs, interleaved and rotated per round:
   default knobs (torch's 25 MiB buckets, no bucket view), the tuned knobs (fed back through
   autotuning.online.knobs), and default knobs again (the A/A control). Each arm's figure is
   samples/s over the run's steps after the first 10.

Run alone (2 cores): nothing else may run beside it. Results: benchmarks/results/online_tuning.csv
and online_tuning_log.csv (the tuning run's own log), and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORKLOAD = ROOT / "benchmarks" / "workloads" / "wide_mlp.py"
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}
ONLINE = {"warmup_samples": 2, "steps_per_sample": 5, "max_samples": 12, "sampling_confidence_time": 0.5,
          "remeasure_top": 3, "remeasure_windows": 3}


def launch(workdir: Path, config: dict, *args: str, online: bool = False) -> subprocess.CompletedProcess:
    path = workdir / f"ds_{abs(hash(json.dumps(config, sort_keys=True)))}.json"
    path.write_text(json.dumps(config))
    mode = ["--autotuning", "online"] if online else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "autotuner", *mode, "--nproc_per_node", "2", str(WORKLOAD),
                             *args, "--deepspeed", str(path)], cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"launch failed:\n{result.stderr[-3000:]}")
    return result


def measure(workdir: Path, knobs: dict, steps: int) -> dict:
    out = workdir / "timings.json"
    config = {**BASE, "autotuning": {"online": {"knobs": knobs}}} if knobs else BASE
    launch(workdir, config, "--steps", str(steps), "--skip", "10", "--timings_out", str(out))
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tune_steps", type=int, default=800)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="online-bench-"))
    try:
        tuning = launch(workdir, {**BASE, "autotuning": {"online": ONLINE}}, "--steps", str(args.tune_steps),
                        online=True)
        done = [line for line in tuning.stdout.splitlines() if "online tuning done" in line]
        if not done:
            sys.exit(f"tuning did not finish in {args.tune_steps} steps; raise --tune_steps:\n{tuning.stdout[-2000:]}")
        print(done[0])
        best = json.loads((workdir / "autotuning_results" / "best_knobs.json").read_text())
        shutil.copy(workdir / "autotuning_results" / "online_log.csv", RESULTS / "online_tuning_log.csv")
        arms = {"default": {}, "tuned": best["knobs"], "default again (A/A)": {}}
        rows = []
        for round_index in range(args.rounds):
            names = list(arms)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                figure = measure(workdir, arms[name], args.steps)
                rows.append({"round": round_index, "arm": name, "samples_per_s": figure["samples_per_s"],
                             "knobs": json.dumps(figure["knobs"], sort_keys=True)})
                print(f"round {round_index} {name}: {figure['samples_per_s']:.1f} samples/s {figure['knobs']}",
                      flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / "online_tuning.csv", index=False)
    default = frame[frame.arm == "default"].set_index("round")["samples_per_s"]
    lines = ["| arm | knobs | samples/s median (min-max) | ratio to default, per round: median (min-max) |",
             "|---|---|---|---|"]
    for name in arms:
        values = frame[frame.arm == name].set_index("round")["samples_per_s"]
        ratios = (values / default).tolist()
        lines.append(f"| {name} | {frame[frame.arm == name].knobs.iloc[0]} | {statistics.median(values):.1f} "
                     f"({min(values):.1f}-{max(values):.1f}) | {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f}) |")
    print(f"\ntuning run: pick {best['knobs']} at step {best['train_iter']}, {best['score']:.1f} samples/s median "
          f"in its own re-measurement against {best['start_score']} at the starting knobs\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
