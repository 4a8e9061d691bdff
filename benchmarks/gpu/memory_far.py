"""Memory far from the profile, on one GPU (issue 49, section 4.2).

Two parts, each writing one CSV to --out_dir:

- `sweep`: the GPT-2 example at a fixed stage, micro-batch 1, 4, 16, ... until the first OOM, each
  launch a profile launch, so its ModelInfo holds the allocator's peaks by phase (forward+backward,
  optimizer step), the overall allocated peak and the caching allocator's reserved peak. These are
  the ground-truth curves a per-phase memory model is checked against (`memory_sweep.csv`).
- `tune`: `launcher --autotuning tune` with `max_train_micro_batch_size_per_gpu` (1024 by default),
  every stage; for each launch the tuner's predicted peak against the measured allocated and reserved
  peaks (`memory_tune.csv`), and the tuner's own log.

    python benchmarks/gpu/memory_far.py --out_dir $OUT --sweep gpt2-medium:256:0,3 \
        --tune gpt2-medium:256 gpt2-large:256 [--deadline_s 520]

Every launch goes through the tuner's own runner and measurement. What the deadline leaves out is
said in the log, not guessed.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, SCRIPT, gpt2_config, script_args, settings_for

from autotuner.app.measure import Experiment, TrialState, journaled_result
from autotuner.execution.cold import ColdRunner
from autotuner.tuning.trials.trial import Trial

STARTED = time.monotonic()
MIB = 2**20


def log(message: str) -> None:
    print(f"[memory_far +{time.monotonic() - STARTED:4.0f}s] {message}", flush=True)


def remaining(args) -> float:
    return args.deadline_s - (time.monotonic() - STARTED)


def mib(value) -> float | None:
    return round(value / MIB, 1) if value else None


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def sweep(args, spec: str, work: Path, rows: list[dict]) -> None:
    preset, seq_len, stages = spec.split(":")
    for stage in (int(s) for s in stages.split(",")):
        directory = work / f"sweep_{preset}_{seq_len}_z{stage}"
        config = gpt2_config(directory, start_step=3, end_step=4, precision=args.precision)
        config_file = directory.with_suffix(".json")
        directory.mkdir(parents=True, exist_ok=True)
        config_file.write_text(json.dumps(config))
        settings = settings_for(config, script_args(preset, int(seq_len), directory, config_file), 3, 4)
        micro = 1
        while micro <= args.max_micro:
            if remaining(args) < args.keep_s:
                log(f"sweep {preset} seq {seq_len} z{stage}: stopped before micro {micro}, out of time")
                return
            trial = Trial(Experiment(stage, micro, 1), directory / f"mbs{micro}", settings, profile=True)
            result = ColdRunner().run(trial)
            info = result.model_info
            row = {"preset": preset, "seq_len": seq_len, "zero_stage": stage, "micro_batch_size": micro,
                   "state": result.state.value, "samples_s": result.value}
            if info is not None:
                row.update(peak_allocated_mib=mib(info.peak_memory_bytes), peak_reserved_mib=mib(info.peak_reserved_bytes),
                           forward_backward_mib=mib(info.forward_backward_peak_bytes),
                           optimizer_step_mib=mib(info.optimizer_step_peak_bytes),
                           activation_mib=mib(info.activation_bytes),
                           optimizer_state_mib=mib(info.optimizer_state_bytes_per_param * info.num_params),
                           device_mib=mib(info.device_memory_bytes))
            metrics = result.measurement
            if metrics is not None:
                row.update(window_peak_allocated_mib=mib(metrics.peak_memory_bytes),
                           window_peak_reserved_mib=mib(metrics.peak_reserved_bytes))
            rows.append(row)
            write_csv(args.out_dir / "memory_sweep.csv", rows)
            log(f"sweep {json.dumps(row)}")
            if result.state is not TrialState.OK:
                break
            micro *= 4 if micro < args.sweep_dense_from else 2


def stopped_launches(exps: Path) -> list[dict]:
    """The launches a tune stopped before its summary kept (journaled results), as experiments.csv
    rows with the columns this script reads. Their phase is not journaled: a folder `NAME_remeasureK`
    is a re-measurement."""
    rows = []
    for path in sorted(exps.glob("*/exp.json")):
        result, folder = journaled_result(path.parent), path.parent.name
        predicted, measured = mib(result.predicted_memory_bytes), mib(result.measured_memory_bytes)
        rows.append({"name": result.name, "phase": "remeasure" if folder != result.name else "",
                     "state": result.state.value, "zero_stage": result.experiment.zero_stage,
                     "micro_batch_size": result.experiment.micro_batch_size, "metric_value": result.value,
                     "predicted_memory_mib": predicted, "measured_memory_mib": measured,
                     "memory_error_pct": round(100 * (predicted - measured) / measured, 1)
                     if predicted and measured else None})
    return rows


def tune(args, spec: str, work: Path, rows: list[dict]) -> None:
    preset, seq_len = spec.split(":")
    if remaining(args) < args.keep_s + 30:
        log(f"tune {spec}: skipped, out of time")
        return
    tune_dir = work / f"tune_{preset}_{seq_len}"
    config = gpt2_config(tune_dir, start_step=3, end_step=8, precision=args.precision, overwrite=True,
                         max_train_micro_batch_size_per_gpu=args.max_micro)
    tune_file = tune_dir.with_suffix(".json")
    tune_dir.mkdir(parents=True, exist_ok=True)
    tune_file.write_text(json.dumps(config))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "1", str(SCRIPT),
               *script_args(preset, int(seq_len), tune_dir, tune_file)]
    started = time.monotonic()
    cap = max(30.0, remaining(args) - args.keep_s)
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=cap)
        output, code = done.stdout + "\n--- stderr ---\n" + done.stderr[-20000:], done.returncode
    except subprocess.TimeoutExpired as stopped:  # subprocess.run kills the launcher, which ends its ranks
        partial = stopped.stdout.decode(errors="replace") if isinstance(stopped.stdout, bytes) else stopped.stdout
        output, code = (partial or "") + "\n(stopped at the cap)", None
    wall = time.monotonic() - started
    with (args.out_dir / "memory_tune.log").open("a") as handle:
        handle.write(f"\n===== {spec}: exit {code} in {wall:.1f} s\n{output}")
    table = tune_dir / "results" / "experiments.csv"
    if table.exists():
        launches = list(csv.DictReader(table.open()))
    else:  # stopped at its cap before its summary: each finished launch's record (exp.json) stands
        launches = stopped_launches(tune_dir / "exps")
        log(f"tune {spec}: no experiments.csv (exit {code}); {len(launches)} launch record(s) read instead")
    remeasured: dict[str, int] = {}
    for launch in launches:
        if launch["state"] == "pruned":
            continue
        folder = launch["name"]
        if launch["phase"] == "remeasure":  # the k-th re-measurement of a name has its own folder
            remeasured[folder] = remeasured.get(folder, 0) + 1
            folder = f"{folder}_remeasure{remeasured[folder]}"
        row = {"preset": preset, "seq_len": seq_len, "tune_wall_s": round(wall, 1), "tune_exit": code,
               **{key: launch[key] for key in ("name", "phase", "state", "zero_stage", "micro_batch_size",
                                               "metric_value", "predicted_memory_mib", "measured_memory_mib",
                                               "memory_error_pct")}}
        metrics = tune_dir / "exps" / folder / "metrics.json"
        if metrics.exists():
            data = json.loads(metrics.read_text())
            row["measured_reserved_mib"] = mib(data.get("peak_reserved_bytes"))
        rows.append(row)
    write_csv(args.out_dir / "memory_tune.csv", rows)
    log(f"tune {spec}: exit {code} in {wall:.0f} s, {sum(r['preset'] == preset and r['seq_len'] == seq_len for r in rows)} launches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", nargs="*", default=[], help="PRESET:SEQ:STAGES, e.g. gpt2-medium:256:0,3")
    parser.add_argument("--tune", nargs="*", default=[], help="PRESET:SEQ, e.g. gpt2-large:256")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="fp32: a CPU dry run")
    parser.add_argument("--max_micro", type=int, default=1024)
    parser.add_argument("--sweep_dense_from", type=int, default=64, help="x4 steps below this micro-batch, x2 above")
    parser.add_argument("--keep_s", type=float, default=15, help="time kept at the end for writing")
    parser.add_argument("--deadline_s", type=float, default=520)
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_memory_far"))
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sweep_rows: list[dict] = []
    tune_rows: list[dict] = []
    # Tunes first: they are what the goal is stated on; the sweep gets what is left.
    for spec in args.tune:
        tune(args, spec, work, tune_rows)
    for spec in args.sweep:
        sweep(args, spec, work, sweep_rows)
    log("done")


if __name__ == "__main__":
    main()
