"""Experiments in parallel inside a two-node Slurm allocation against the same tune one at a time;
with `--compare warm`, warm launches (each node's preloaded server) against cold ones.

    python benchmarks/slurm_parallel.py [--rounds 3] [--tuner_type gridsearch|predictive] [--compare parallel|warm]

Needs Slurm's packages and root: the two-node test cluster of the suite (tests/slurm_cluster.py,
two slurmd on this machine) is started for the run and stopped after. The same tune of the toy
script (tests/workers/toy_train.py, ZeRO 0 and 1 x micro-batches 1-32, 1 rank per experiment, `--ms_per_step` of sleep so a step
costs time but no CPU, cold launches, no final re-measurement) runs inside `salloc -N2` with
`--backend slurm --num_nodes 1` three ways, interleaved for --rounds rounds:
- parallel: the default, two experiments at once (one per node);
- sequential: `--slurm_max_concurrent 1`, the same allocation one experiment at a time;
- sequential_again: the same as sequential, the A/A control of the noise.
`--compare warm` runs the same tune two at once three ways: cold, warm, and warm again (the A/A
control); results in benchmarks/results/slurm_warm.csv.
Per run: tuning wall time (from the summary), launches, the pick. Reported: medians, spreads,
and the ratios of medians. On this machine both "nodes" share its 2 cores, so each launcher's
start-up (a CPU-bound torch import) is slower beside another than alone; on a real cluster each
node has its own. Results: benchmarks/results/slurm_parallel.csv and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from slurm_cluster import start_cluster, stop_cluster  # noqa: E402  (the suite's cluster, started the same way)

TOY = ROOT / "tests" / "workers" / "toy_train.py"
RESULTS = {"parallel": ROOT / "benchmarks" / "results" / "slurm_parallel.csv",
           "warm": ROOT / "benchmarks" / "results" / "slurm_warm.csv"}
# mode: (the launcher's extra flags, autotuning.warm_start)
COMPARISONS = {
    "parallel": {"parallel": ((), False), "sequential": (("--slurm_max_concurrent", "1"), False),
                 "sequential_again": (("--slurm_max_concurrent", "1"), False)},
    "warm": {"cold": ((), False), "warm": ((), True), "warm_again": ((), True)},
}
# (the ratio reported, its A/A control), each as (numerator, denominator)
RATIOS = {"parallel": (("parallel", "sequential"), ("sequential_again", "sequential")),
          "warm": (("warm", "cold"), ("warm_again", "warm"))}
MAPPINGS = {"train_micro_batch_size_per_gpu": "--micro_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def config(tuner_type: str, warm: bool) -> dict:
    # The micro-batch sizes as a list: each is a candidate the tuner asks for (so a search of
    # its own, not only the profile's and the largest size's launches, which run one at a time).
    return {"train_micro_batch_size_per_gpu": [1, 2, 4, 8, 16, 32], "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "zero_optimization": {"stage": [0, 1]},
            "autotuning": {"enabled": True, "arg_mappings": MAPPINGS, "start_profile_step": 2, "end_profile_step": 4,
                           "exp_timeout_s": 120, "tuner_type": tuner_type, "remeasure_rounds": 0, "history": False,
                           "warm_start": warm, "max_train_micro_batch_size_per_gpu": 32, "tuner_early_stopping": 20}}


def tune(cluster, folder: Path, mode: str, flags: tuple[str, ...], warm: bool, tuner_type: str) -> dict:
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text(json.dumps(config(tuner_type, warm)))
    env = cluster.env({**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    command = ["salloc", "--nodes=2", "--job-name=bench", sys.executable, "-m", "autotuner", "--autotuning", "tune",
               "--backend", "slurm", "--num_nodes", "1", "--nproc_per_node", "1", *flags, str(TOY),
               "--ms_per_step", "200", "--steps", "8", "--deepspeed", "ds.json"]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = (folder / "autotuning_results" / "summary.txt").read_text()
    h, m, s = re.search(r"Tuning completed in (\d+):(\d+):(\d+(?:\.\d+)?)", summary).groups()
    launches = int(re.search(r"Launches: (\d+)", summary).group(1))
    table = pd.read_csv(folder / "autotuning_results" / "experiments.csv")
    pick = table[table.chosen].iloc[0]["name"]
    return {"mode": mode, "tuning_s": int(h) * 3600 + int(m) * 60 + float(s), "launches": launches, "pick": pick,
            "hosts": " ".join(sorted(set(table.hosts.dropna())))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tuner_type", default="gridsearch")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="parallel")
    args = parser.parse_args()
    modes = COMPARISONS[args.compare]
    work = Path(tempfile.mkdtemp(prefix="slurm-bench-", dir="/tmp"))
    cluster = start_cluster(work / "cluster")
    rows = []
    try:
        for round_index in range(args.rounds):
            for mode, (flags, warm) in modes.items():
                row = tune(cluster, work / f"r{round_index}_{mode}", mode, flags, warm, args.tuner_type)
                rows.append({"round": round_index, "tuner_type": args.tuner_type, **row})
                print(rows[-1], flush=True)
    finally:
        stop_cluster(cluster)
        shutil.rmtree(work, ignore_errors=True)
    frame = pd.DataFrame(rows)
    RESULTS[args.compare].parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS[args.compare], index=False)
    medians = {mode: statistics.median(frame[frame["mode"] == mode].tuning_s) for mode in modes}
    print("| mode | median tuning s | min | max | launches | picks |\n|---|---:|---:|---:|---|---|")
    for mode in modes:
        part = frame[frame["mode"] == mode]
        print(f"| {mode} | {medians[mode]:.1f} | {part.tuning_s.min():.1f} | {part.tuning_s.max():.1f} | "
              f"{sorted(set(part.launches))} | {sorted(set(part.pick))} |")
    (a, b), (c, d) = RATIOS[args.compare]
    print(f"\n{a} / {b}: {medians[a] / medians[b]:.2f}; A/A ({c} / {d}): {medians[c] / medians[d]:.2f}")


if __name__ == "__main__":
    main()
