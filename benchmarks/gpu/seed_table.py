"""The seed's table on our engine, one GPU: baseline, hand-tuned, and `launcher --autotuning tune`.

- baseline: micro-batch 1, ZeRO 0, no tuning;
- hand-tuned: micro-batch doubled from 1 until the first out-of-memory (the seed's rule), at the best
  stage: the autotuned pick's (--hand_stage pick), or a stage given;
- autotuned: the tuner's own run (every stage, micro-batch searched), its wall time and launches;
then the three picks re-measured by one harness, interleaved, with tokens/s and MFU (analytic
FLOPs per token against the bf16 matrix-product rate measured in the same call).

    python benchmarks/gpu/seed_table.py --preset gpt2-large --out_dir $OUT [--deadline_s 560]

Every launch goes through the tuner's public measuring API (autotuner.app.measure). What the
deadline leaves out (hand-tuned sizes, re-measurement rounds) is said, not guessed.
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

import pandas as pd
from common import ROOT, SCRIPT, flops_per_token, gpt2_config, matmul_flops, script_args, settings_for

from autotuner.app.measure import Experiment, TrialState, measure

STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[seed_table +{time.monotonic() - STARTED:4.0f}s] {message}", flush=True)


def remaining(args) -> float:
    return args.deadline_s - (time.monotonic() - STARTED)


def hand_tuned(args, work: Path, stage: int) -> tuple[list, float]:
    """At one stage, micro-batch 1, 2, 4, ... until the first launch that does not run."""
    config = gpt2_config(work / "hand", start_step=3, end_step=8, precision=args.precision)
    config_file = work / "hand.json"
    config_file.write_text(json.dumps(config))
    settings = settings_for(config, script_args(args.preset, args.seq_len, work / "hand", config_file), 3, 8)
    results, micro, started = [], 1, time.monotonic()
    while micro <= args.max_micro and remaining(args) > 60 * args.rounds + 30:  # keep the re-measurement's time
        result = measure(Experiment(stage, micro, 1), settings, work / "hand" / f"z{stage}_mbs{micro}")
        results.append(result)
        log(f"hand-tuned z{stage} micro {micro}: {result.state.value} {result.value}")
        if result.state is not TrialState.OK:
            break
        micro *= 2
    return results, time.monotonic() - started


def autotuned(args, work: Path) -> dict:
    tune_dir = work / "tune"
    config = gpt2_config(tune_dir, start_step=3, end_step=8, precision=args.precision, overwrite=True,
                         max_train_micro_batch_size_per_gpu=args.max_micro)
    tune_file = work / "tune.json"
    tune_file.write_text(json.dumps(config))
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "1", str(SCRIPT),
               *script_args(args.preset, args.seq_len, tune_dir, tune_file)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.tune_cap_s)
        output, code = done.stdout + "\n--- stderr ---\n" + done.stderr[-20000:], done.returncode
    except subprocess.TimeoutExpired as stopped:  # subprocess.run kills the launcher, which ends its ranks
        partial = stopped.stdout.decode(errors="replace") if isinstance(stopped.stdout, bytes) else stopped.stdout
        output, code = (partial or "") + "\n(stopped at the cap)", None
    wall = time.monotonic() - started
    (args.out_dir / "seed_tune.log").write_text(output)
    table_path = tune_dir / "results" / "experiments.csv"
    table = pd.read_csv(table_path) if table_path.exists() else pd.DataFrame(columns=["state", "chosen"])
    if table_path.exists():  # every launch with its predicted and measured memory
        (args.out_dir / "seed_experiments.csv").write_text(table_path.read_text())
    launched = table[table.state != "pruned"]
    chosen = table[table.chosen == True]  # noqa: E712 (a pandas mask)
    pick = None
    if len(chosen):
        row = chosen.iloc[0]
        pick = Experiment(int(row.zero_stage), int(row.micro_batch_size), int(row.gradient_accumulation_steps))
    log(f"autotuned: exit {code} in {wall:.0f} s, {len(launched)} launches, pick {pick.name if pick else None}")
    return {"pick": pick, "wall_s": wall, "launches": len(launched),
            "oom_launches": int((launched.state == "oom").sum()), "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-large")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="fp32: a CPU dry run")
    parser.add_argument("--max_micro", type=int, default=1024, help="stop doubling here even without an OOM")
    parser.add_argument("--hand_stage", default="pick",
                        help="the stage the hand rule doubles at: 'pick' (the autotuned pick's, the best) or 0-3")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved re-measurement rounds")
    parser.add_argument("--tune_cap_s", type=float, default=300, help="the autotuner's time cap")
    parser.add_argument("--deadline_s", type=float, default=560, help="whole-run budget")
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_seed"))
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    peak, per_token = matmul_flops(), flops_per_token(args.preset, args.seq_len)
    log(f"bf16 matmul {peak / 1e12:.0f} TFLOP/s; {per_token / 1e9:.2f} GFLOP per token")

    # The tuner first: it is the row the table exists for; the hand rule gets what is left.
    tune = autotuned(args, work)
    if args.hand_stage != "pick":
        hand_stage = int(args.hand_stage)
    else:
        hand_stage = tune["pick"].zero_stage if tune["pick"] is not None else 0
    hand, hand_wall = hand_tuned(args, work, hand_stage)
    contenders = {"baseline": Experiment(0, 1, 1)}  # no tuning: ZeRO 0, micro-batch 1
    if hand:
        ran = [r for r in hand if r.state is TrialState.OK]
        if ran:
            contenders["hand-tuned"] = max(ran, key=lambda r: r.value).experiment
    if tune["pick"] is not None:
        contenders["autotuned"] = tune["pick"]

    config = gpt2_config(work / "remeasure", start_step=3, end_step=13, precision=args.precision)
    config_file = work / "remeasure.json"
    config_file.write_text(json.dumps(config))
    settings = settings_for(config, script_args(args.preset, args.seq_len, work / "remeasure", config_file), 3, 13)
    remeasured: dict[str, list[float]] = {name: [] for name in contenders}
    for round_index in range(args.rounds):
        for name, experiment in contenders.items():
            if remaining(args) < 40:
                log(f"re-measure {round_index} {name}: skipped, out of time")
                continue
            result = measure(experiment, settings, work / "remeasure" / f"{name}_{round_index}")
            if result.state is TrialState.OK:
                remeasured[name].append(result.value)
            log(f"re-measure {round_index} {name} {experiment.name}: {result.state.value} {result.value}")

    rows = []
    for name, experiment in contenders.items():
        values = remeasured[name]
        median = statistics.median(values) if values else None
        tokens = median * args.seq_len if median else None
        row = {"preset": args.preset, "seq_len": args.seq_len, "setup": name, "config": experiment.name,
               "samples_s_median": round(median, 3) if median else None,
               "samples_s_values": ";".join(f"{v:.3f}" for v in values),
               "tokens_s": round(tokens) if tokens else None,
               "mfu_pct": round(100 * tokens * per_token / peak, 1) if tokens else None,
               "matmul_tflops": round(peak / 1e12, 1)}
        if name == "baseline":
            row.update(launches=0, tuning_wall_s=None, oom_launches=0)
        elif name == "hand-tuned":
            row.update(launches=len(hand), tuning_wall_s=round(hand_wall, 1),
                       oom_launches=sum(r.state is TrialState.OOM for r in hand))
        else:
            row.update(launches=tune["launches"], tuning_wall_s=round(tune["wall_s"], 1),
                       oom_launches=tune["oom_launches"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if rows:
        with (args.out_dir / "gpu_seed_table.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    log("done")


if __name__ == "__main__":
    main()
