"""Tuning quality: our autotuner's pick against the exhaustive grid over the same space.

    python benchmarks/tuning_quality.py [--workloads gpt2,mlp,convnet] [--repeats 2]
                                        [--runs gridsearch:fast,model_based:full,...] [--interference N]

For each workload (2 CPU ranks, OMP_NUM_THREADS=1 per rank, a memory_per_rank_bytes budget that
makes some stages infeasible):
1. the grid: every stage x micro-batch (gas = max_train_batch_size / (micro x 2)), each measured
   `--repeats` times in interleaved rounds (A B C .. A B C ..), scored by the median; a run over
   the budget is OOM, as in tuning;
2. the autotuner, once per tuner and mode, as a user runs it (`launcher --autotuning tune`);
3. each pick is re-measured interleaved with the grid's best (A B A B), and quality is the
   ratio of their medians.
With `--interference N`, N CPU-bound processes run beside the tuner while it tunes (a shared
node); the grid and the re-measurements stay neutral, so the ratio says how good the pick made
under interference really is.
Results go to benchmarks/results/tuning_quality.csv and a markdown table on stdout; every grid
point's median to benchmarks/results/tuning_quality_grid.csv (with `--runs none` and `--reuse_grid`,
only that table, read back from an earlier run's grid). Each workload's line on stdout gives one
launch's run-to-run spread, pooled over the grid's repeated configurations: the noise the tuner's
step-time model must assume (its NOISE_FLOOR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from autotuner.app.measure import (Experiment, ExperimentSettings, TrialState, journaled_result, measure_once,
                                   measurement_settings, run_command)

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results"
MAPPINGS_HF = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
               "gradient_accumulation_steps": "--gradient_accumulation_steps"}
MAPPINGS_OURS = {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                 "gradient_accumulation_steps": "--gradient_accumulation_steps"}


@dataclass(frozen=True)
class Workload:
    name: str
    script: str
    args: tuple[str, ...]
    arg_mappings: dict = field(hash=False)
    micro_batch_sizes: tuple[int, ...]
    max_train_batch_size: int
    memory_per_rank_bytes: int

    def config(self, **autotuning) -> dict:
        return {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "zero_optimization": {"stage": "all"},
            "autotuning": {
                "enabled": True,
                "arg_mappings": self.arg_mappings,
                "start_profile_step": 3,
                "end_profile_step": 8,
                "max_train_batch_size": self.max_train_batch_size,
                "max_train_micro_batch_size_per_gpu": max(self.micro_batch_sizes),
                "memory_per_rank_bytes": self.memory_per_rank_bytes,
                "exp_timeout_s": 300,
                **autotuning,
            },
        }


WORKLOADS = {
    "gpt2": Workload("gpt2", "examples/hf_gpt2/train.py",
                     ("--model_size", "tiny", "--max_steps", "50", "--output_dir", str(ROOT / "output/bench_gpt2")),
                     MAPPINGS_HF, (4, 8, 16, 32), 64, 750 * 2**20),
    "mlp": Workload("mlp", "examples/minimal/train.py", ("--steps", "50", "--width", "2048", "--depth", "6"),
                    MAPPINGS_OURS, (8, 16, 32, 64), 128, 1000 * 2**20),
    "convnet": Workload("convnet", "benchmarks/workloads/convnet.py", ("--steps", "50"),
                        MAPPINGS_OURS, (8, 16, 32, 64), 128, 700 * 2**20),
    # best micro-batch 32, not the largest that fits (64); every stage x micro fits (peak 805 MiB)
    "knee": Workload("knee", "benchmarks/workloads/knee.py", ("--steps", "50"),
                     MAPPINGS_OURS, (8, 16, 32, 64), 128, 900 * 2**20),
    # ZeRO 1 beats ZeRO 0 (AdamW's CPU step dominates); every stage x micro fits (peak 758 MiB)
    "zero1_wins": Workload("zero1_wins", "benchmarks/workloads/zero1_wins.py", ("--steps", "50"),
                           MAPPINGS_OURS, (8, 16, 32, 64), 128, 900 * 2**20),
}


def grid(workload: Workload) -> list[Experiment]:
    out = []
    for stage in (0, 1, 2, 3):
        for micro in workload.micro_batch_sizes:
            gas = workload.max_train_batch_size // (micro * 2)
            if gas >= 1:
                out.append(Experiment(stage, micro, gas))
    return out


def settings_for(workload: Workload) -> ExperimentSettings:
    return measurement_settings(ROOT / workload.script, workload.args, workload.config(), start_profile_step=3,
                                end_profile_step=8, arg_mappings=workload.arg_mappings,
                                memory_budget_bytes=workload.memory_per_rank_bytes)


def measure_rounds(experiments: list[Experiment], settings: ExperimentSettings, rounds: int, work: Path,
                   reuse: bool = False) -> dict:
    """Interleaved rounds; returns {experiment: [results]}. With `reuse`, a run whose record is
    already in `work` (an interrupted benchmark's) is read back, not launched again."""
    measured: dict[Experiment, list] = {e: [] for e in experiments}
    for round_index in range(rounds):
        for experiment in experiments:
            exp_dir = work / f"{experiment.name}_r{round_index}"
            measured[experiment].append(measure_once(experiment, settings, exp_dir, reuse))
    return measured


def median_value(results: list) -> float | None:
    values = [r.value for r in results if r.state is TrialState.OK]
    return statistics.median(values) if len(values) == len(results) and values else None


def spread(results: list) -> float:
    values = [r.value for r in results if r.state is TrialState.OK]
    return (max(values) - min(values)) / 2 if len(values) > 1 else 0.0


def launch_spread(rounds: dict) -> tuple[float, int] | None:
    """One launch's run-to-run spread (relative std), pooled over the configurations whose every
    interleaved round ran: the noise each launch the tuner makes carries. With it, the number of
    configurations it rests on."""
    variances = []
    for results in rounds.values():
        values = [r.value for r in results if r.state is TrialState.OK and r.value]
        if len(values) == len(results) > 1:
            variances.append(statistics.variance([math.log(v) for v in values]))
    return (math.sqrt(statistics.fmean(variances)), len(variances)) if variances else None


def busy_loops(count: int) -> list:
    """CPU-bound processes, each its own process group (ended in `stop_busy_loops`)."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]


def stop_busy_loops(loops: list) -> None:
    for loop in loops:
        loop.kill()
        loop.wait()


def run_autotuner(workload: Workload, tuner: str, mode: str, work: Path, interference: int = 0) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "ds.json"
    config_path.write_text(json.dumps(workload.config(tuner_type=tuner, fast=(mode == "fast"), overwrite=True)))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2",
               str(ROOT / workload.script), *workload.args, "--deepspeed", str(config_path)]
    # A process group, ended with its experiments if this benchmark is stopped.
    loops = busy_loops(interference)
    try:
        done = run_command(command, work, timeout_s=3 * 3600)
    finally:
        stop_busy_loops(loops)
    wall = done.wall_time_s
    stdout = (work / "stdout.log").read_text()
    table = pd.read_csv(work / "autotuning_results" / "experiments.csv")
    # Every launch counts: profile launches are experiments (phase "profile"), re-measurements too.
    launched = table[table.state != "pruned"]
    chosen_rows = table[table.chosen]
    # The pick with its knobs (full mode), as the tuner recorded it.
    chosen = None if chosen_rows.empty else journaled_result(work / "autotuning_exps" / chosen_rows.iloc[0]["name"]).experiment
    predicted = dict(re.findall(r"z(\d)=(\d+)", stdout.split("largest micro-batch per stage:")[-1].split("\n")[0]))
    measured_again = stdout.count("measuring it again")
    return {
        "returncode": done.returncode, "wall_s": wall, "experiments": len(launched),
        "measured_again": measured_again,
        "oom_or_failed": int((launched.state != "ok").sum()),
        "chosen": chosen,
        "predicted_max_micro": {int(k): int(v) for k, v in predicted.items()},
    }


def evaluate(workload: Workload, runs: list[tuple[str, str]], repeats: int, work: Path,
             reuse_grid: bool, interference: int = 0) -> list[dict]:
    settings = settings_for(workload)
    space = grid(workload)
    grid_runs = measure_rounds(space, settings, repeats, work / "grid", reuse=reuse_grid)
    grid_wall = sum(r.wall_time_s for results in grid_runs.values() for r in results)
    scores = {e: median_value(r) for e, r in grid_runs.items()}
    feasible = {e: s for e, s in scores.items() if s is not None}
    best = max(feasible, key=feasible.get)
    measured_max = {stage: max((e.micro_batch_size for e in feasible if e.zero_stage == stage), default=0)
                    for stage in (0, 1, 2, 3)}
    grid_rows = [{"workload": workload.name, "zero_stage": e.zero_stage, "micro_batch_size": e.micro_batch_size,
                  "gradient_accumulation_steps": e.gradient_accumulation_steps,
                  "samples_per_s_median": round(scores[e], 2) if scores[e] is not None else None,
                  "runs": " ".join(f"{r.value:.2f}" if r.state is TrialState.OK else r.state.value
                                   for r in grid_runs[e]),
                  "measured": time.strftime("%Y-%m-%d", time.localtime(min(
                      (work / "grid" / f"{e.name}_r{i}" / "result.json").stat().st_mtime for i in range(repeats))))}
                 for e in space]
    merge_csv(RESULTS / "tuning_quality_grid.csv", grid_rows,
              ["workload", "zero_stage", "micro_batch_size", "gradient_accumulation_steps"])
    noise = launch_spread(grid_runs)
    if noise is not None:
        print(f"{workload.name}: one launch's run-to-run spread {noise[0]:.1%} (the grid's {repeats} interleaved "
              f"rounds, {noise[1]} configurations)", flush=True)
    rows = []
    for tuner, mode in runs:
        run = run_autotuner(workload, tuner, mode, work / f"tune_{tuner}_{mode}_busy{interference}", interference)
        chosen = run["chosen"]
        ratio = best_spread = None
        if chosen is not None:
            pair = [chosen, best] if chosen != best else [best]
            again = measure_rounds(pair, settings, repeats, work / f"remeasure_{tuner}_{mode}_busy{interference}")
            chosen_score, best_score = median_value(again[chosen]), median_value(again[best])
            ratio = chosen_score / best_score if chosen_score and best_score else None
            best_spread = spread(again[best]) / best_score if best_score else None
        rows.append({
            "date": time.strftime("%Y-%m-%d"), "workload": workload.name, "tuner": tuner, "mode": mode,
            "interference": interference, "measured_again": run["measured_again"],
            "budget_mib": workload.memory_per_rank_bytes // 2**20,
            "chosen": chosen.name if chosen else None, "grid_best": best.name,
            "grid_best_samples_per_s": round(feasible[best], 2),
            "grid_best_spread_pct": round(100 * spread(grid_runs[best]) / feasible[best], 1),
            "chosen_over_best": round(ratio, 3) if ratio else None,
            "remeasure_best_spread_pct": round(100 * best_spread, 1) if best_spread is not None else None,
            "experiments": run["experiments"], "grid_experiments": len(space),
            "wall_s": round(run["wall_s"], 1), "grid_wall_s": round(grid_wall / repeats, 1),
            "oom_or_failed": run["oom_or_failed"],
            "predicted_max_micro": run["predicted_max_micro"], "measured_max_micro": measured_max,
            "omp_num_threads": os.environ["OMP_NUM_THREADS"], "load_avg_1m": round(os.getloadavg()[0], 2),
        })
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt2,mlp,convnet")
    parser.add_argument("--runs", default="gridsearch:fast,random:fast,model_based:fast,gridsearch:full,"
                        "random:full,model_based:full",
                        help="tuner:mode pairs to run, comma-separated; none: only the grid")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work_dir", default="output/tuning_quality")
    parser.add_argument("--interference", type=int, default=0,
                        help="CPU-bound processes to run beside the tuner while it tunes")
    parser.add_argument("--reuse_grid", action="store_true",
                        help="read back grid runs an earlier (interrupted) run of this benchmark left in --work_dir")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM unwinds like Ctrl-C, so the running launch's process tree is ended on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rows = []
    for name in args.workloads.split(","):
        runs = [] if args.runs == "none" else [tuple(pair.split(":")) for pair in args.runs.split(",")]
        rows += evaluate(WORKLOADS[name], runs, args.repeats, Path(args.work_dir).resolve() / name, args.reuse_grid,
                         args.interference)
        if rows:  # after each workload: a long run keeps its rows
            table = merge_csv(RESULTS / "tuning_quality.csv", rows, ["workload", "tuner", "mode", "interference"])
    if not rows:
        return
    print(table.drop(columns=["predicted_max_micro", "measured_max_micro"]).to_markdown(index=False))


def merge_csv(path: Path, rows: list[dict], key: list[str]) -> pd.DataFrame:
    """Write `rows` into the CSV at `path`, replacing rows with the same `key` values and keeping
    the rest (a later run of one workload leaves the others' results); returns the whole table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    if path.exists():
        old = pd.read_csv(path)
        if "interference" in key and "interference" not in old.columns:
            old["interference"] = 0  # rows from before the column: measured on a quiet machine
        if set(key) <= set(old.columns):
            replaced = old.set_index(key).index.isin(table.set_index(key).index)
            table = pd.concat([old[~replaced], table], ignore_index=True)
    table.to_csv(path, index=False)
    return table

if __name__ == "__main__":
    main()
