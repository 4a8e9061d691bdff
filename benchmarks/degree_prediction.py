"""The 4-rank `tensor_parallel.autotp_size: "auto"` tune, checkout against checkout: its launches,
its pick, and what degree 1's launches predicted for the other degrees (issue 80, part 1).

    python benchmarks/degree_prediction.py --checkout before=/tmp/old-clone --checkout after=. \
        [--checkout every=. --unbounded every] [--rounds 3]

Each round runs one real tune per checkout, interleaved (before, after, before, ...), of
tests/workers/tp_train.py (the AutoTP block model of tests/integration/test_tensor_parallel.py,
25,024 parameters split) on 4 CPU ranks: degrees 1, 2 and 4, ZeRO 0-2, train_batch_size 16,
micro-batches up to 4. Per tune: the launches (experiments.csv rows that ran), those per degree,
the pick, the wall time, and the summary's lines on each degree (its bound from degree 1 and
its profile launches' predicted against measured memory and step time). A checkout named by
--unbounded runs with `autotuning.bound_layouts: false` (every degree profiled, so each degree's
launches can be held against degree 1's predictions; checkouts from 930b9c3 on). 4 ranks on 2
cores: the step times are contended; the load average at each start is printed. `--ranks 2` runs
the same tune on 2 ranks (degrees 1 and 2, train_batch_size 8): a core a rank on this machine, so
its step times are the uncontended check of the step-time model.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": [0, 1, 2]},
          "tensor_parallel": {"autotp_size": "auto"},
          "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "exp_timeout_s": 120,
                         "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False,
                         "max_train_micro_batch_size_per_gpu": 4, "arg_mappings": {}}}


def tune(checkout: Path, directory: Path, unbounded: bool = False, ranks: int = 4) -> dict:
    config = json.loads(json.dumps(CONFIG))
    config["train_batch_size"] = 4 * ranks  # (the same samples a rank at every rank count)
    if unbounded:
        config["autotuning"]["bound_layouts"] = False
    (directory / "ds.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    load = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", str(ranks),
                           str(checkout / "tests" / "workers" / "tp_train.py"), "--steps", "40", "--out",
                           str(directory / "out"), "--deepspeed", "ds.json"], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the tune failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(directory / "autotuning_results" / "experiments.csv") as handle:
        rows = list(csv.DictReader(handle))
    ran = [row for row in rows if row["state"] != "pruned"]
    summary = (directory / "autotuning_results" / "summary.txt").read_text()
    lines = [line for line in summary.splitlines() if re.match(r"layout: tensor parallel [24]", line)]
    return {"launches": len(ran), "per_degree": {tp: sum(1 for r in ran if r["tp"] == tp) for tp in ("1", "2", "4")},
            "pick": next((row["name"] for row in rows if row["chosen"] == "True"), ""), "wall_s": round(wall, 1),
            "load": round(load, 2), "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", action="append", required=True, help="NAME=PATH of a checkout to run")
    parser.add_argument("--unbounded", action="append", default=[], help="NAME of a checkout run with every degree "
                                                                           "profiled (autotuning.bound_layouts false)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=4)
    parser.add_argument("--csv", default="degree_prediction.csv", help="under benchmarks/results/")
    args = parser.parse_args()
    checkouts = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.checkout)]
    rows = []
    for round_ in range(args.rounds):
        for name, checkout in checkouts:
            with tempfile.TemporaryDirectory() as directory:
                found = tune(checkout, Path(directory), name in args.unbounded, args.ranks)
            print(f"round {round_ + 1} {name}: {found['launches']} launches {found['per_degree']}, pick {found['pick']}, "
                  f"{found['wall_s']} s (load {found['load']})", flush=True)
            for line in found["lines"]:
                print(f"    {line}", flush=True)
            rows.append({"round": round_ + 1, "checkout": name, "launches": found["launches"],
                         **{f"launches_tp{tp}": n for tp, n in found["per_degree"].items()}, "pick": found["pick"],
                         "wall_s": found["wall_s"], "load_at_start": found["load"], "lines": " | ".join(found["lines"])})
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / args.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"rows: {RESULTS / args.csv}")


if __name__ == "__main__":
    main()
