"""One launch's noise: the same configuration launched back to back, on this machine.

    python benchmarks/launch_noise.py [--workloads convnet,gpt2] [--launches 8]

For each workload of tuning_quality.py (2 CPU ranks, OMP_NUM_THREADS=1 per rank), its grid's best
configuration in benchmarks/results/tuning_quality_grid.csv is launched `--launches` times in a row,
each a short measured run as the tuner launches it. Printed per workload: the values, their spread
(std of the log values: one launch's relative noise), the same from successive differences (which
a slow drift of the machine does not inflate), and the window's own error (the per-step spread over
the steps timed, TrialResult.relative_error), the figure a launch reports about itself. The
tuner's step-time model assumes one launch carries NOISE_FLOOR (3%) at least; this says what
the machine gives. Nothing is written but the runs' directories under --work_dir.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuning_quality import RESULTS, WORKLOADS, launch_spread, measure_rounds, settings_for  # noqa: E402

from autotuner.app.measure import Experiment, TrialState  # noqa: E402


def grid_best(workload: str) -> Experiment:
    grid = pd.read_csv(RESULTS / "tuning_quality_grid.csv")
    rows = grid[grid.workload == workload].dropna(subset=["samples_per_s_median"])
    best = rows.loc[rows.samples_per_s_median.idxmax()]
    return Experiment(int(best.zero_stage), int(best.micro_batch_size), int(best.gradient_accumulation_steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="convnet,gpt2")
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--work_dir", default="output/launch_noise")
    args = parser.parse_args()
    if args.launches < 3:
        parser.error(f"--launches {args.launches}: at least 3 are needed for a spread")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print("| workload | configuration | samples/s, in launch order | one launch's spread | from successive "
          "differences | window's own error (median) | load average |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        workload, experiment = WORKLOADS[name], grid_best(name)
        started = time.monotonic()
        results = measure_rounds([experiment], settings_for(workload), args.launches,
                                 Path(args.work_dir).resolve() / name)[experiment]
        ran = [r for r in results if r.state is TrialState.OK and r.value]
        values = [r.value for r in ran]
        if len(values) < 3:
            print(f"| {name} | {experiment.name} | {len(values)} of {args.launches} launches ran | | | | |")
            continue
        logs = [math.log(v) for v in values]
        successive = math.sqrt(statistics.fmean((b - a) ** 2 for a, b in zip(logs, logs[1:])) / 2)
        window = statistics.median(r.relative_error for r in ran)
        spread, _ = launch_spread({experiment: ran})
        print(f"| {name} | {experiment.name} | {' '.join(f'{v:.1f}' for v in values)} | "
              f"{spread:.1%} | {successive:.1%} | {window:.1%} | {os.getloadavg()[0]:.2f} |",
              flush=True)
        print(f"<!-- {name}: {time.monotonic() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
