"""The seed's table on our engine, one GPU: baseline, hand-tuned, and `launcher --autotuning tune`.

- baseline: micro-batch 1, ZeRO 0, no tuning;
- hand-tuned: micro-batch doubled from 1 at ZeRO 0 until the first CUDA OOM;
- autotuned: the tuner's own run (every stage, micro-batch searched), its wall time and launches;
then the three picks re-measured by one harness, interleaved, and the MFU of the best against
the bf16 matrix-product rate measured in the same call.

    python benchmarks/gpu/seed_table.py --preset gpt2-large --out_dir $OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, SCRIPT, gpt2_config, script_args, settings_for

from autotuner.tuning.experiment import run_experiment
from autotuner.tuning.records import TrialResult, TrialState
from autotuner.tuning.space import Experiment

MATMUL = """
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); start = time.perf_counter()
for _ in range(20): a @ b
torch.cuda.synchronize(); print(20 * 2 * 8192**3 / (time.perf_counter() - start))
"""


def matmul_flops() -> float:
    """bf16 8192^3 matrix products per second, in a child so this process never holds a CUDA context."""
    child = subprocess.run([sys.executable, "-c", MATMUL], capture_output=True, text=True)
    return float(child.stdout) if child.returncode == 0 else float("nan")  # no GPU: no MFU


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2-large")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--max_micro", type=int, default=1024, help="stop doubling here even without an OOM")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved re-measurement rounds")
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_seed"))
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    peak = matmul_flops()
    print(f"bf16 matmul: {peak / 1e12:.0f} TFLOP/s", flush=True)

    # Baseline and hand-tuned, through the tuner's experiment runner (same measurement as the tuner).
    config = gpt2_config(work / "hand", start_step=3, end_step=8)
    config_file = work / "hand.json"
    config_file.write_text(json.dumps(config))
    settings = settings_for(config, script_args(args.preset, args.seq_len, work / "hand", config_file), 3, 8)
    hand, micro, started = [], 1, time.monotonic()
    while True:
        result = run_experiment(Experiment(0, micro, 1), work / "hand" / f"z0_mbs{micro}", settings)
        hand.append(result)
        print(f"hand-tuned z0 micro {micro}: {result.state.value} {result.value}", flush=True)
        if result.state is not TrialState.OK or micro * 2 > args.max_micro:
            break
        micro *= 2
    hand_wall = time.monotonic() - started
    baseline = hand[0]
    hand_best = max((r for r in hand if r.state is TrialState.OK), key=lambda r: r.value)

    # The autotuner, as a user runs it.
    tune_dir = work / "tune"
    tune_config = gpt2_config(tune_dir, start_step=3, end_step=8, overwrite=True)
    tune_file = work / "tune.json"
    tune_file.write_text(json.dumps(tune_config))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "1", str(SCRIPT),
               *script_args(args.preset, args.seq_len, tune_dir, tune_file)]
    started = time.monotonic()
    tuned = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    tune_wall = time.monotonic() - started
    (args.out_dir / "seed_tune_stdout.log").write_text(tuned.stdout + "\n--- stderr ---\n" + tuned.stderr[-20000:])
    records = [TrialResult.from_json(json.loads(p.read_text())) for p in (tune_dir / "exps").glob("*/exp.json")]
    profile_runs = len(list((tune_dir / "exps").glob("profile_*")))
    pick_line = [line for line in tuned.stdout.splitlines() if "is the optimal setup" in line]
    pick_name = pick_line[-1].split("autotuner: ")[1].split(" is the optimal")[0] if pick_line else None
    pick = next((r.experiment for r in records if r.name == pick_name), None)

    # Re-measure the three, interleaved, by one harness with a longer window.
    long_settings = settings_for(config, settings.script_args, 3, 13)
    contenders = {"baseline": baseline.experiment, "hand-tuned": hand_best.experiment}
    if pick is not None:
        contenders["autotuned"] = pick
    remeasured: dict[str, list[float]] = {name: [] for name in contenders}
    flops: dict[str, float] = {}
    for round_index in range(args.rounds):
        for name, experiment in contenders.items():
            result = run_experiment(experiment, work / "remeasure" / f"{name}_{round_index}", long_settings)
            if result.state is TrialState.OK:
                remeasured[name].append(result.value)
                flops[name] = result.metrics.get("FLOPS_per_gpu", 0.0)
            print(f"re-measure {round_index} {name} {experiment.name}: {result.state.value} {result.value}", flush=True)

    rows = []
    for name, experiment in contenders.items():
        values = remeasured[name]
        median = statistics.median(values) if values else None
        row = {"preset": args.preset, "seq_len": args.seq_len, "setup": name, "config": experiment.name,
               "throughput_samples_s_median": round(median, 3) if median else None,
               "throughput_values": ";".join(f"{v:.3f}" for v in values),
               "tflops_per_gpu": round(flops.get(name, 0) / 1e12, 1),
               "mfu_pct": round(100 * flops.get(name, 0) / peak, 1),
               "matmul_tflops": round(peak / 1e12, 1)}
        if name == "baseline":
            row.update(launches=1, tuning_wall_s=None, oom_launches=0)
        elif name == "hand-tuned":
            row.update(launches=len(hand), tuning_wall_s=round(hand_wall, 1),
                       oom_launches=sum(r.state is TrialState.OOM for r in hand))
        else:
            row.update(launches=len(records) + profile_runs, tuning_wall_s=round(tune_wall, 1),
                       oom_launches=sum(r.state is TrialState.OOM for r in records))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with (args.out_dir / "gpu_seed_table.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
