"""Transfer: tuning a GPT-2 family at growing size, with the history's earlier runs against cold.

    python benchmarks/transfer.py [--models 4,8,12] [--rounds 3] [--csv transfer.csv]
    python benchmarks/transfer.py --models gpt2,gpt2-medium,gpt2-large --nproc 1 --precision bf16 \
        --seq_len 1024 --out_dir $OUT          # on a lent GPU (benchmarks/gpu/run_all.sh transfer)

The GPT-2 example (examples/hf_gpt2/train.py): a number is the "tiny" preset at that many
blocks, BxW the tiny preset at B blocks of width W (`--models 4x128,4x512`: a fourfold width),
a name is one of its presets. `--nproc` ranks (2 CPU ranks by default), tuner_type
predictive in fast mode, every stage, a global batch of `--global_batch` (64):
1. the first model is tuned cold, its launches recorded in a history (SQLite);
2. each later one is tuned twice, as a user would run `launcher --autotuning tune`: with that
   history (autotuning.transfer, the default) and cold (a history of its own, empty);
3. when the two picks differ they are re-measured interleaved (A B A B ..., `--rounds`), and the
   pick ratio is transfer's median over cold's.
Results: `--out_dir`/`--csv` (benchmarks/results/transfer.csv), rewritten after each model, and a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

from autotuner.app.measure import Experiment, TrialState, measure_once, measurement_settings, run_command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "output" / "bench_transfer"
SCRIPT = ROOT / "examples" / "hf_gpt2" / "train.py"
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def script_args(model: str, args: argparse.Namespace) -> tuple[str, ...]:
    if re.fullmatch(r"\d+x\d+", model):  # blocks x width of the tiny preset
        blocks, width = model.split("x")
        size: tuple[str, ...] = ("--model_size", "tiny", "--n_layer", blocks, "--n_embd", width)
    else:
        size = ("--model_size", "tiny", "--n_layer", model) if model.isdigit() else ("--model_size", model)
    # One data directory: the example's BPE tokenizer is trained once, not per model.
    return (*size, "--seq_len", str(args.seq_len), "--max_steps", "50", "--output_dir", str(WORK / "train"))


def config(storage: str, args: argparse.Namespace) -> dict:
    precision = {"bf16": {"enabled": True}} if args.precision == "bf16" else {}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": "all"},
            "autotuning": {"enabled": True, "fast": True, "tuner_type": "predictive", "arg_mappings": MAPPINGS,
                           "start_profile_step": 3, "end_profile_step": 8, "max_train_batch_size": args.global_batch,
                           "max_train_micro_batch_size_per_gpu": args.global_batch // args.nproc,
                           "storage": storage, "exp_timeout_s": 300}}


def tune(name: str, model: str, storage: str, args: argparse.Namespace) -> dict:
    directory = WORK / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ds.json").write_text(json.dumps(config(storage, args)))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", str(args.nproc),
               str(SCRIPT), *script_args(model, args), "--deepspeed", "ds.json"]
    started = time.monotonic()
    outcome = run_command(command, directory, timeout_s=1800)
    wall = time.monotonic() - started
    stdout = (directory / "stdout.log").read_text()
    if outcome.returncode != 0:
        raise SystemExit(f"{name}: the tune failed ({outcome.returncode}); see {directory}/stderr.log")
    counts = re.search(r"Launches: (\d+)(?: \((\d+) of them profile launches(?:, (\d+) re-measurements?)?\))?", stdout)
    launches, profile, remeasured = (int(n or 0) for n in counts.groups())
    table = pd.read_csv(directory / "autotuning_results" / "experiments.csv")
    chosen = table[table.chosen].iloc[0]
    lines = [line for line in stdout.splitlines() if line.startswith("autotuner: transfer:")]
    return {"name": name, "model": model, "launches": launches, "profile": profile,
            "search": launches - profile - remeasured, "remeasured": remeasured, "wall_s": round(wall, 1),
            "pick": chosen["name"],
            "pick_value": round(float(chosen.metric_value if "metric_value" in chosen else chosen.value), 2),
            "transfer": " | ".join(line.removeprefix("autotuner: ") for line in lines)}


def experiment_from(name: str) -> Experiment:
    stage, gas, micro = re.match(r"z(\d)_gas(\d+)_mbs(\d+)$", name).groups()
    return Experiment(int(stage), int(micro), int(gas))


def remeasure(model: str, names: list[str], args: argparse.Namespace) -> tuple[dict[str, float], str]:
    """Each pick's median over `args.rounds` interleaved launches, and every value (the spread)."""
    settings = measurement_settings(SCRIPT, script_args(model, args), config("", args), nproc_per_node=args.nproc,
                                    start_profile_step=3, end_profile_step=8, arg_mappings=MAPPINGS)
    values: dict[str, list[float]] = {name: [] for name in names}
    for index in range(args.rounds):
        for name in names:
            result = measure_once(experiment_from(name), settings, WORK / f"remeasure_{model}_{name}_{index}",
                                  reuse=False)
            if result.state is TrialState.OK:
                values[name].append(result.value)
    spread = "; ".join(f"{name}: {', '.join(f'{v:.1f}' for v in vs)}" for name, vs in values.items())
    return {name: statistics.median(v) if v else float("nan") for name, v in values.items()}, spread


def report(rows: list[dict], path: Path) -> None:
    frame = pd.DataFrame(rows)
    frame.insert(0, "date", time.strftime("%Y-%m-%d"))
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    print(frame.drop(columns=["transfer", "picks_remeasured"], errors="ignore").to_markdown(index=False))
    for row in rows:
        if row.get("transfer"):
            print(f"- {row['name']}: {row['transfer']}")
        if row.get("picks_remeasured"):
            print(f"- {row['name']} picks re-measured (samples/s): {row['picks_remeasured']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", "--layers", default="4,8,12",
                        help="blocks of the tiny preset (the issue's 4, 8 and 12), BLOCKSxWIDTH, or preset names, smallest first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs on a GPU machine)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--global_batch", type=int, default=64)
    parser.add_argument("--out_dir", type=Path, default=RESULTS)
    parser.add_argument("--csv", default="transfer.csv", help="file name under --out_dir")
    args = parser.parse_args()
    models = args.models.split(",")
    # From nothing: an earlier run's history would be a prior, its journals would be resumed.
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    shared = f"sqlite:///{WORK / 'history.db'}"
    rows = [tune(f"cold_{models[0]}", models[0], shared, args) | {"mode": "cold (seeds the history)"}]
    for model in models[1:]:
        warm = tune(f"transfer_{model}", model, shared, args) | {"mode": "transfer"}
        cold = tune(f"cold_{model}", model, f"sqlite:///{WORK / f'cold_{model}.db'}", args) | {"mode": "cold"}
        if warm["pick"] != cold["pick"]:
            medians, warm["picks_remeasured"] = remeasure(model, [warm["pick"], cold["pick"]], args)
            ratio = medians[warm["pick"]] / medians[cold["pick"]]
        else:
            ratio, warm["picks_remeasured"] = 1.0, "same pick"
        warm["pick_ratio_vs_cold"] = round(ratio, 3)
        warm["launch_ratio_vs_cold"] = round(warm["launches"] / cold["launches"], 2)
        warm["wall_ratio_vs_cold"] = round(warm["wall_s"] / cold["wall_s"], 2)
        rows += [warm, cold]
        report(rows, args.out_dir / args.csv)  # each model as it ends: a call cut short keeps what it did


if __name__ == "__main__":
    main()
