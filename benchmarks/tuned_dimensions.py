"""Tuned dimensions: what activation checkpointing and compile as "auto" cost in launches, and
what they buy, on a GPT-2-style model under a tight memory budget.

    python benchmarks/tuned_dimensions.py [--n_layer 6] [--seq_len 256] [--budget_mib 1150]
                                          [--planned_steps 300] [--rounds 3]

1. `launcher --autotuning tune` twice on the same workload (2 CPU ranks, the hf_gpt2 example
   with --n_layer blocks): "fixed" (activation_checkpointing "none", compile false: the search
   as before) and "auto" (both "auto"), each with autotuning.planned_steps.
2. Each tune's launches (profile and re-measurements included), its out-of-memory launches and
   its wall time; the goal is at most 1.5x the fixed tune's launches, and no OOM.
3. The two picks re-measured interleaved, `--rounds` rounds of (fixed, auto, fixed again: the
   A/A control), scored by the median of the planned-run throughput (one-off costs included)
   and of the steady throughput.
Results: benchmarks/results/tuned_dimensions.csv and a markdown table on stdout. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from autotuner.app.measure import journaled_result, measure_once, measurement_settings
from autotuner.tuning.space.planned_run import planned_value
from autotuner.tuning.space.records import Objective, TrialState

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "hf_gpt2" / "train.py"
RESULTS = ROOT / "benchmarks" / "results"
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def config(args: argparse.Namespace, tuned: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": [0, 1]},
        "activation_checkpointing": {"policy": "auto" if tuned else "none"},
        "compile": {"enabled": "auto" if tuned else False},
        "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 6, "max_train_batch_size": 64,
                       "max_train_micro_batch_size_per_gpu": 32, "memory_per_rank_bytes": args.budget_mib * 2**20,
                       "planned_steps": args.planned_steps, "exp_timeout_s": 600, "arg_mappings": MAPPINGS},
    }


def script_args(args: argparse.Namespace) -> list[str]:
    return ["--model_size", "tiny", "--n_layer", str(args.n_layer), "--seq_len", str(args.seq_len),
            "--max_steps", str(args.planned_steps), "--output_dir", "out"]


def tune(work: Path, args: argparse.Namespace, tuned: bool) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds.json").write_text(json.dumps(config(args, tuned)))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2", str(SCRIPT),
               *script_args(args), "--deepspeed", "ds.json"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True)
    wall = time.monotonic() - started
    (work / "tune.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"tune in {work} failed; see {work / 'tune.log'}")
    table = pd.read_csv(work / "autotuning_results" / "experiments.csv")
    launched = table[table.state != "pruned"]
    chosen = table[table.chosen].iloc[0]["name"]
    return {"variant": "auto" if tuned else "fixed", "launches": len(launched),
            "oom": int((launched.state == "oom").sum()), "tune_wall_s": round(wall, 1), "pick": chosen,
            "pick_dir": str(work / "autotuning_exps" / chosen), "config": config(args, tuned)}


def remeasure(tunes: list[dict], args: argparse.Namespace, work: Path) -> dict[str, list[tuple[float, float]]]:
    """(planned-run throughput, steady throughput) per round for fixed, auto and fixed again."""
    objective = Objective("throughput")
    order = [("fixed", tunes[0]), ("auto", tunes[1]), ("fixed_again", tunes[0])]
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in order}
    for round_ in range(args.rounds):
        for name, tuned in order:
            experiment = journaled_result(tuned["pick_dir"]).experiment
            settings = measurement_settings(SCRIPT, tuple(script_args(args)), tuned["config"], start_profile_step=3,
                                            end_profile_step=6, arg_mappings=MAPPINGS,
                                            memory_budget_bytes=args.budget_mib * 2**20, timeout_s=600)
            result = measure_once(experiment, settings, work / f"{name}_round{round_}")
            if result.state is not TrialState.OK:
                raise SystemExit(f"re-measuring {experiment.name} ({name}) failed: {result.error}")
            m = result.measurement
            figures[name].append((planned_value(m, objective, args.planned_steps, m.throughput), m.throughput))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--budget_mib", type=int, default=1150)
    parser.add_argument("--planned_steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/tuned_dimensions")
    args = parser.parse_args()
    work = Path(args.work)
    load = os.getloadavg()[0]
    tunes = [tune(work / "fixed", args, tuned=False), tune(work / "auto", args, tuned=True)]
    figures = remeasure(tunes, args, work / "remeasure")
    medians = {name: (statistics.median(p for p, _ in runs), statistics.median(s for _, s in runs))
               for name, runs in figures.items()}
    rows = []
    for tuned in tunes:
        name = tuned["variant"]
        planned, steady = medians[name]
        runs = figures[name]
        rows.append({"variant": name, "pick": tuned["pick"], "launches": tuned["launches"], "oom": tuned["oom"],
                     "tune_wall_s": tuned["tune_wall_s"], "planned_samples_s": round(planned, 2),
                     "planned_range": f"{min(p for p, _ in runs):.2f}-{max(p for p, _ in runs):.2f}",
                     "steady_samples_s": round(steady, 2)})
    table = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    table.to_csv(RESULTS / "tuned_dimensions.csv", index=False)
    print(f"load average before: {load:.2f}; n_layer {args.n_layer}, seq_len {args.seq_len}, budget "
          f"{args.budget_mib} MiB per rank, planned_steps {args.planned_steps}, {args.rounds} rounds")
    print(table.to_markdown(index=False))
    print(f"launches auto/fixed: {tunes[1]['launches'] / tunes[0]['launches']:.2f} (goal <= 1.5)")
    print(f"planned-run throughput auto/fixed: {medians['auto'][0] / medians['fixed'][0]:.3f}; "
          f"A/A (fixed again/fixed): {medians['fixed_again'][0] / medians['fixed'][0]:.3f}")


if __name__ == "__main__":
    main()
