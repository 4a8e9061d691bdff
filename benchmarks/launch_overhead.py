"""Warm against cold launches: per-experiment overhead, the figures each path measures, and the
tuning wall time of the README's GPT-2 example.

    python benchmarks/launch_overhead.py [--rounds 3] [--tune_rounds 2] [--skip_tune]

Part 1, overhead. For each workload (the minimal example's MLP, torch only; the GPT-2 example,
torch + transformers) one fixed experiment (ZeRO 0, micro-batch 8, gas 1, profile steps 3-5,
2 CPU ranks) is launched through the cold runner and the warm runner, interleaved per round as
cold, warm, warm-again (the A/A control). Overhead = launch wall time minus the time of the
steps the ranks ran (end_profile_step x the median measured step), so it is what starting,
rendezvous and leaving cost. Throughput is compared too: the figures must not depend on the path.

Part 2, tuning wall time. `launcher --autotuning tune` on examples/hf_gpt2 (the README's command,
overwrite true), with autotuning.warm_start true and false, interleaved cold, warm per round. The
two runs' experiments.csv give each path's ranking of the same experiments.

Run alone (2 cores): nothing else may run beside it. Results: benchmarks/results/launch_overhead.csv
and launch_overhead_tune.csv, and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

from autotuner.app.measure import (Experiment, ExperimentSettings, TrialState, cold_runner, measure,
                                   measurement_settings, run_command, warm_runner)

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results"
GPT2 = ROOT / "examples" / "hf_gpt2"
README_ARGS = ("--model_size", "tiny", "--max_steps", "200", "--output_dir", "output/gpt2")  # command 1's
WORKLOADS = {
    "mlp (torch only)": (ROOT / "examples" / "minimal" / "train.py", ("--steps", "50"),
                         {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}},
                         {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                          "gradient_accumulation_steps": "--gradient_accumulation_steps"}),
    "gpt2 (transformers)": (GPT2 / "train.py", README_ARGS,
                            json.loads((GPT2 / "ds_config.json").read_text()),
                            {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                             "gradient_accumulation_steps": "--gradient_accumulation_steps"}),
}


def settings_for(script: Path, args: tuple[str, ...], config: dict, mappings: dict) -> ExperimentSettings:
    return measurement_settings(script, args, {**config, "zero_optimization": {"stage": 0}}, timeout_s=600,
                                start_profile_step=3, end_profile_step=5, arg_mappings=mappings)


def overhead_rows(rounds: int, work: Path) -> list[dict]:
    rows = []
    cold = cold_runner()
    warm = warm_runner(WORKLOADS["gpt2 (transformers)"][0], report=lambda line: print(f"  {line}"))
    try:
        for name, (script, args, config, mappings) in WORKLOADS.items():
            settings = settings_for(script, args, config, mappings)
            experiment = Experiment(0, 8, 1)
            for round_index in range(rounds):
                for path, runner in (("cold", cold), ("warm", warm), ("warm (A/A)", warm)):
                    directory = work / f"{name.split()[0]}_{path.split()[0]}{'_aa' if 'A/A' in path else ''}_r{round_index}"
                    result = measure(experiment, settings, directory, runner)
                    if result.state is not TrialState.OK:
                        raise SystemExit(f"{name} {path}: {result.state.value}: {result.error}")
                    steps = result.measurement.step_wall_s_values
                    stepping = settings.end_profile_step * statistics.median(steps)
                    rows.append({"workload": name, "path": path, "round": round_index,
                                 "wall_s": round(result.wall_time_s, 3), "steps_s": round(stepping, 3),
                                 "overhead_s": round(result.wall_time_s - stepping, 3),
                                 "samples_per_s": round(result.value, 2)})
                    print(f"  {name} round {round_index} {path}: wall {result.wall_time_s:.2f} s, overhead "
                          f"{result.wall_time_s - stepping:.2f} s, {result.value:.1f} samples/s", flush=True)
    finally:
        warm.close()
    return rows


def tune_rows(rounds: int, work: Path) -> list[dict]:
    rows = []
    for round_index in range(rounds):
        for warm_start in (False, True):
            directory = work / f"tune_{'warm' if warm_start else 'cold'}_r{round_index}"
            directory.mkdir(parents=True, exist_ok=True)
            config = json.loads((GPT2 / "ds_config.json").read_text())
            config["autotuning"].update(warm_start=warm_start, overwrite=True)
            (directory / "ds.json").write_text(json.dumps(config))
            command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2",
                       str(GPT2 / "train.py"), *README_ARGS, "--deepspeed", str(directory / "ds.json")]
            done = run_command(command, directory, timeout_s=3600)
            if done.returncode != 0:
                raise SystemExit(f"tuning failed ({done.returncode}); see {directory}/stderr.log")
            table = pd.read_csv(directory / "autotuning_results" / "experiments.csv")
            launched = table[table.state != "pruned"]
            ok = launched[launched.state == "ok"].sort_values("metric_value", ascending=False)
            rows.append({"path": "warm" if warm_start else "cold", "round": round_index,
                         "wall_s": round(done.wall_time_s, 1),
                         "launches": len(launched) + len(list((directory / "autotuning_exps").glob("profile_*"))),
                         "pick": ok.iloc[0]["name"], "ranking": " > ".join(ok["name"]),
                         "throughputs": ";".join(f"{n}={v:.1f}" for n, v in zip(ok["name"], ok["metric_value"]))})
            print(f"  tune {rows[-1]['path']} round {round_index}: {done.wall_time_s:.1f} s, pick {rows[-1]['pick']}",
                  flush=True)
    return rows


def summarise(rows: list[dict], tunes: list[dict]) -> str:
    frame = pd.DataFrame(rows)
    lines = ["| workload | path | median overhead s (min-max) | median wall s | median samples/s (min-max) |",
             "|---|---|---|---|---|"]
    for (workload, path), group in frame.groupby(["workload", "path"], sort=False):
        lines.append(f"| {workload} | {path} | {group.overhead_s.median():.2f} ({group.overhead_s.min():.2f}-"
                     f"{group.overhead_s.max():.2f}) | {group.wall_s.median():.2f} | {group.samples_per_s.median():.1f} "
                     f"({group.samples_per_s.min():.1f}-{group.samples_per_s.max():.1f}) |")
    if tunes:
        tune = pd.DataFrame(tunes)
        cold, warm = (tune[tune.path == p].wall_s for p in ("cold", "warm"))
        lines += ["", "| GPT-2 example tuning | wall s per round | median | launches | pick |", "|---|---|---|---|---|"]
        for path, group in tune.groupby("path", sort=False):
            lines.append(f"| {path} | {', '.join(map(str, group.wall_s))} | {group.wall_s.median():.1f} | "
                         f"{', '.join(map(str, group.launches))} | {', '.join(group.pick)} |")
        lines.append(f"\nwarm / cold tuning wall time: {warm.median() / cold.median():.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune_rounds", type=int, default=2)
    parser.add_argument("--skip_tune", action="store_true")
    parser.add_argument("--work_dir", default=str(ROOT / "output" / "launch_overhead"))
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores", flush=True)
    rows = overhead_rows(args.rounds, work)
    RESULTS.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(RESULTS / "launch_overhead.csv", index=False)
    tunes = [] if args.skip_tune else tune_rows(args.tune_rounds, work)
    if tunes:
        pd.DataFrame(tunes).to_csv(RESULTS / "launch_overhead_tune.csv", index=False)
    print(summarise(rows, tunes))
    print(f"\nbenchmark wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
