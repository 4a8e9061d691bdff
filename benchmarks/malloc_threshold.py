"""What a fixed glibc mmap threshold costs in throughput, and what it buys in predictable peaks.

    python benchmarks/malloc_threshold.py [--workloads gpt2,mlp,convnet,knee,zero1_wins] [--rounds 3]
                                          [--thresholds 131072,1048576] [--csv NAME.csv]

Under `autotuning.memory_per_rank_bytes` on a CPU, the tuner sets MALLOC_MMAP_THRESHOLD_=131072 for
the ranks where the user has not set it: glibc's moving threshold makes a rank's resident set vary
by tens of percent between runs, which no memory model can hold to. This measures the price.

For each workload of benchmarks/tuning_quality.py (2 CPU ranks, its budget), one experiment in the
middle of its grid (ZeRO 0 and ZeRO 3 at its second micro-batch size) is launched cold in three
arms, interleaved and rotated by one each round: `off` (the environment as it is), `off again` (the
same, an A/A control for the machine's drift) and one arm per threshold in `--thresholds`
(MALLOC_MMAP_THRESHOLD_ set to it; 131072 by default). Each arm's throughput is the median over
rounds; the table gives each arm over `off`, with the range of the per-round ratios, and each
arm's peak resident set across rounds (min-max). Alone on the machine: the load average at the
start is printed with the table.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from tuning_quality import WORKLOADS, settings_for  # noqa: E402

from autotuner.app.measure import Experiment, TrialState, measure  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def launch(arm: str, experiment: Experiment, settings, directory: Path):
    """One cold launch with the arm's environment (the cold runner passes os.environ to the ranks):
    "off" and "off again" as the environment is, "threshold N" with MALLOC_MMAP_THRESHOLD_=N."""
    before = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if arm.startswith("threshold "):
        os.environ["MALLOC_MMAP_THRESHOLD_"] = arm.split()[1]
    try:
        return measure(experiment, settings, directory)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if before is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt2,mlp,convnet,knee,zero1_wins")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", default="0,3")
    parser.add_argument("--thresholds", default="131072")
    parser.add_argument("--csv", default="malloc_threshold.csv")
    parser.add_argument("--work_dir", default=str(ROOT / "output" / "malloc_threshold"))
    args = parser.parse_args()
    arms = ("off", "off again", *(f"threshold {t}" for t in args.thresholds.split(",")))
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        parser.error("MALLOC_MMAP_THRESHOLD_ is set in this environment: unset it, the `off` arms need glibc's default")
    load = os.getloadavg()
    rows = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        settings = settings_for(workload)
        micro = workload.micro_batch_sizes[1]
        for stage in (int(s) for s in args.stages.split(",")):
            experiment = Experiment(stage, micro, max(1, workload.max_train_batch_size // (micro * 2)))
            runs: dict[str, list] = {arm: [] for arm in arms}
            for round_index in range(args.rounds):
                order = arms[round_index % len(arms):] + arms[:round_index % len(arms)]
                for arm in order:
                    directory = Path(args.work_dir) / name / f"{experiment.name}_{arm.replace(' ', '_')}_r{round_index}"
                    result = launch(arm, experiment, settings, directory)
                    runs[arm].append(result)
                    print(f"{name} {experiment.name} round {round_index} {arm}: {result.state.value} "
                          f"{result.value if result.value is not None else result.error}", flush=True)
            rows += rows_of(name, experiment.name, runs)
    write(rows, load, RESULTS / args.csv)


def rows_of(workload: str, experiment: str, runs: dict[str, list]) -> list[dict]:
    """One row per arm: its median over `off`'s, the per-round ratios' range, its peaks' range."""
    def values(arm: str) -> list[float]:
        return [r.value if r.state is TrialState.OK else float("nan") for r in runs[arm]]

    base = values("off")
    rows = []
    for arm in runs:
        ratios = [v / b for v, b in zip(values(arm), base)]
        peaks = [r.measured_memory_bytes / 2**20 for r in runs[arm] if r.measured_memory_bytes]
        ok = [v for v in values(arm) if v == v]
        rows.append({"workload": workload, "experiment": experiment, "arm": arm,
                     "launches": len(runs[arm]), "out_of_memory": sum(r.state is TrialState.OOM for r in runs[arm]),
                     "median_samples_per_s": statistics.median(ok) if ok else float("nan"),
                     "ratio_to_off": statistics.median(values(arm)) / statistics.median(base),
                     "ratio_low": min(ratios), "ratio_high": max(ratios),
                     "peak_mib_low": min(peaks, default=float("nan")), "peak_mib_high": max(peaks, default=float("nan"))})
    return rows


def write(rows: list[dict], load: tuple[float, float, float], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nload average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    print("| workload | experiment | arm | samples/s over off (per-round range) | peak MiB (min-max) | OOM |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['experiment']} | {r['arm']} | {r['ratio_to_off']:.3f} ({r['ratio_low']:.3f}-"
              f"{r['ratio_high']:.3f}) | {r['peak_mib_low']:.0f}-{r['peak_mib_high']:.0f} | "
              f"{r['out_of_memory']} of {r['launches']} |")


if __name__ == "__main__":
    main()
