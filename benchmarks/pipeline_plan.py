"""A pipeline's hardware plan held against its real launches on this machine (issue 80, part 3):
`--autotuning plan --hardware` on a spec of this CPU, against a tune of the same layouts.

    python benchmarks/pipeline_plan.py [--ranks 2] [--rounds 1] [--csv benchmarks/results/pipeline_plan.csv]

Each round: the CPU measured afresh (`python -m autotuner.app.host_spec`); one tune of
tests/workers/pipe_gpt_train.py (a GPT-style PipelineModule, tied embedding and head; here 4
blocks of width 256, sequence 64, vocabulary 2048) over `--ranks` CPU ranks at 1 and 2 stages
(`pipeline.stages` mapped to its --pp), ZeRO 0 and 1, micro-batch 4, gas 4, 1F1B; then the plan of
the same config, the compute efficiency fitted on one launch (1 stage, ZeRO 0: its `calibrate`),
every other figure predicted. Printed: each launch's step time and peak resident set against the
plan's (a profile launch holds its probes' memory too, so only the search launches' memory is
compared). 2 ranks on this 2-core machine: a core a rank.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "workers" / "pipe_gpt_train.py"
MODEL = ("--blocks", "4", "--dim", "256", "--seq", "64", "--vocab", "2048", "--steps", "12")
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": [0, 1]},
          "pipeline": {"stages": [1, 2], "schedule": "1F1B"},
          "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 8, "remeasure_rounds": 0,
                         "history": False, "arg_mappings": {"pipeline.stages": "--pp"}}}
FITTED_ON = "z0_pp1_gas4_mbs4"


def _run(command: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:6])}...: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done


def one_round(where: Path, ranks: int) -> list[dict]:
    where.mkdir(parents=True)
    (where / "ds.json").write_text(json.dumps(CONFIG))
    _run([sys.executable, "-m", "autotuner.app.host_spec", "--out", str(where / "cpu.json")], where)
    _run([sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", str(ranks), str(SCRIPT),
          *MODEL, "--deepspeed", "ds.json"], where)
    with open(where / "autotuning_results" / "experiments.csv") as f:
        launches = [row for row in csv.DictReader(f) if row["state"] == "ok"]
    fitted = next(row for row in launches if row["name"] == FITTED_ON)
    spec = json.loads((where / "cpu.json").read_text())
    spec["calibrate"] = {"layout": FITTED_ON, "step_s": float(fitted["latency_s"])}
    plan_dir = where / "plan"
    plan_dir.mkdir()
    (plan_dir / "spec.json").write_text(json.dumps(spec))
    (plan_dir / "ds.json").write_text(json.dumps(CONFIG))
    said = _run([sys.executable, "-m", "autotuner", "--autotuning", "plan", "--hardware", "spec.json",
                 "--nproc_per_node", str(ranks), str(SCRIPT), *MODEL, "--deepspeed", "ds.json"], plan_dir).stdout
    with open(plan_dir / "autotuning_results" / "plan.csv") as f:
        planned = {row["name"]: row for row in csv.DictReader(f)}
    efficiency = float(next(iter(planned.values()))["compute_efficiency"])
    rows = []
    for launch in launches:
        plan = planned[launch["name"]]
        step, predicted = float(launch["latency_s"]), float(plan["predicted_step_s"])
        memory, predicted_memory = float(launch["measured_memory_mib"]), int(plan["predicted_memory_bytes"]) / 2**20
        rows.append({"ranks": ranks, "layout": launch["name"], "phase": launch["phase"], "step_s": step,
                     "predicted_s": predicted, "step_error": predicted / step - 1, "memory_mib": memory,
                     "predicted_mib": predicted_memory,
                     "memory_error": predicted_memory / memory - 1 if launch["phase"] != "profile" else "",
                     "efficiency": efficiency, "fitted": launch["name"] == FITTED_ON})
    print(said.splitlines()[0])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipeline_plan_") as directory:
        for round_ in range(args.rounds):
            rows += [{"round": round_ + 1, **row} for row in one_round(Path(directory) / f"round{round_}", args.ranks)]
    for row in rows:
        memory = f"{row['memory_error']:+.1%}" if row["memory_error"] != "" else "(profile)"
        step = "fitted" if row["fitted"] else f"{row['step_error']:+.1%}"
        print(f"round {row['round']} {row['ranks']} ranks {row['layout']:18} {row['phase']:8} step {row['step_s']:.4f} "
              f"s, predicted {row['predicted_s']:.4f} ({step}); "
              f"memory {row['memory_mib']:.0f} MiB, predicted {row['predicted_mib']:.0f} ({memory})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
