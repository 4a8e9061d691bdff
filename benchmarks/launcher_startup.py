"""The launcher's own start-up and exit, against a baseline checkout: the wall time of whole
launcher commands, which is what a user (and the test suite) waits for beyond the ranks' work.

    git worktree add /tmp/baseline <commit>
    python benchmarks/launcher_startup.py --baseline /tmp/baseline [--rounds 5]

Two commands, each run with this checkout's package and the baseline's (PYTHONPATH first, so the
baseline's `autotuner` is imported by the launcher, its forkserver and its ranks alike):
- tune: `launcher --autotuning tune` of the toy script (tests/workers/toy_train.py), 3 warm
  launches (2 profile, 1 search), no re-measurement, no history;
- run: a plain `launcher --nproc_per_node 2` of the minimal example, 8 steps.
Interleaved per round as baseline, this, this again (the A/A control: how far two runs of the
same code land apart). Launch counts are checked equal, so the times compare like with like.

Run alone (2 cores): nothing else may run beside it. Results: benchmarks/results/launcher_startup.csv
and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOY = ROOT / "tests" / "workers" / "toy_train.py"
MINIMAL = ROOT / "examples" / "minimal" / "train.py"
TUNE_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "zero_optimization": {"stage": 0},
    "autotuning": {"enabled": True, "tuner_type": "gridsearch", "start_profile_step": 2, "end_profile_step": 4,
                   "remeasure_rounds": 0, "history": False, "max_train_micro_batch_size_per_gpu": 16,
                   "max_train_batch_size": 64,
                   "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro_batch_size",
                                    "gradient_accumulation_steps": "--gradient_accumulation_steps"}},
}
RUN_CONFIG = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}


def commands(workdir: Path) -> dict[str, list[str]]:
    (workdir / "tune.json").write_text(json.dumps(TUNE_CONFIG))
    (workdir / "run.json").write_text(json.dumps(RUN_CONFIG))
    launcher = [sys.executable, "-m", "autotuner"]
    return {
        "tune": [*launcher, "--autotuning", "tune", "--nproc_per_node", "2", str(TOY), "--ms_per_sample", "1",
                 "--ms_per_step", "20", "--deepspeed", str(workdir / "tune.json")],
        "run": [*launcher, "--nproc_per_node", "2", str(MINIMAL), "--steps", "8", "--deepspeed",
                str(workdir / "run.json")],
    }


def timed(command: list[str], package_root: Path, workdir: Path) -> tuple[float, int | None]:
    """Wall seconds of one command, and the launches its summary reports (tune only)."""
    for results in ("autotuning_results", "autotuning_exps"):
        shutil.rmtree(workdir / results, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": f"{package_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.monotonic()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    found = re.search(r"Launches: (\d+)", done.stdout)
    return wall, int(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not (args.baseline / "autotuner" / "__init__.py").is_file():
        raise SystemExit(f"--baseline: {args.baseline} is not a checkout of this project (no autotuner/ in it)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="launcher-startup-") as scratch:
        workdir = Path(scratch)
        for round_ in range(args.rounds):
            for name, command in commands(workdir).items():
                for variant, root in (("baseline", args.baseline.resolve()), ("this", ROOT), ("this again", ROOT)):
                    wall, launches = timed(command, root, workdir)
                    rows.append({"command": name, "variant": variant, "round": round_, "wall_s": round(wall, 3),
                                 "launches": launches})
                    print(f"round {round_} {name:4s} {variant:10s} {wall:6.2f} s", flush=True)
    table = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    table.to_csv(RESULTS / "launcher_startup.csv", index=False)
    print(f"\n| command | baseline median s (range) | this median s (range) | this again median s | "
          f"this / baseline | A/A: again / this |\n|---|---|---|---|---|---|")
    for name, group in table.groupby("command", sort=False):
        if group.launches.notna().any() and group.launches.nunique() != 1:
            print(f"warning: {name}: launch counts differ across runs: {sorted(group.launches.unique())}")
        walls = {v: sorted(g.wall_s) for v, g in group.groupby("variant")}
        med = {v: statistics.median(w) for v, w in walls.items()}
        print(f"| {name} | {med['baseline']:.2f} ({walls['baseline'][0]:.2f}-{walls['baseline'][-1]:.2f}) | "
              f"{med['this']:.2f} ({walls['this'][0]:.2f}-{walls['this'][-1]:.2f}) | {med['this again']:.2f} | "
              f"{med['this'] / med['baseline']:.2f} | {med['this again'] / med['this']:.2f} |")


if __name__ == "__main__":
    main()
