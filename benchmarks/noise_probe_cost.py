"""What reading the gradient noise costs a training step (issue 70: below 2% on the GPT-2 example).

The batch ramp (autotuning.adapt_batch) keeps the goodput probe on through training: a DDP
communication hook reading each bucket's squared norm before and after the all-reduce, and one
scalar all-reduce a step. This trains the GPT-2 example (tiny, 2 ranks, micro-batch 4 x gas 8,
ZeRO 0, the README's pick) three ways, interleaved over --rounds rounds:

- off: the example's config as it is;
- probe: the same with adapt_batch on, its plan's interval too long to ever change the batch, so
  only the reading differs;
- off again: the A/A control, whose ratio to "off" is the noise the probe's ratio must stand out of.

A run's rate is the median samples/s of its print windows after the first. Alone on the machine:

    python benchmarks/noise_probe_cost.py [--rounds 3 --steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hf_gpt2"
RATE = re.compile(r"step \d+/\d+: loss [\d.]+, ([\d.]+) samples/s")


def configs(work: Path) -> dict[str, Path]:
    base = json.loads((EXAMPLE / "ds_config.json").read_text())
    base.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8, steps_per_print=10,
                zero_optimization={"stage": 0})
    base.pop("autotuning")
    plan = work / "plan.json"
    plan.write_text(json.dumps({"reference_batch": 64, "lr_scaling": "none", "interval": 10**9,
                                "costs": [{"micro_batch_size": 4, "micro_step_s": 1.0, "step_s": 0.0}],
                                "csv_path": "", "initial_b_noise": None}))
    probe = {**base, "autotuning": {"adapt_batch": True, "adapt_interval": 10**9, "metric": "goodput",
                                    "reference_batch_size": 64, "lr_scaling": "none", "adapt_plan": str(plan)}}
    paths = {}
    for name, config in (("off", base), ("probe", probe)):
        paths[name] = work / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    return paths


def run(config: Path, steps: int, work: Path) -> float:
    command = [sys.executable, "-m", "autotuner", "--nproc_per_node", "2", str(EXAMPLE / "train.py"),
               "--model_size", "tiny", "--max_steps", str(steps), "--output_dir", str(work / "out"),
               "--deepspeed", str(config)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    rates = [float(rate) for rate in RATE.findall(done.stdout)][1:]  # the first window holds the warm-up
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = configs(work)
        arms = {"off": [], "probe": [], "off again": []}
        for _ in range(args.rounds):
            for arm in arms:
                arms[arm].append(run(paths["probe" if arm == "probe" else "off"], args.steps, work))
    off = statistics.median(arms["off"])
    print("| arm | samples/s per run | median | ratio to off |\n|---|---|---|---|")
    for arm, rates in arms.items():
        print(f"| {arm} | {', '.join(f'{r:.1f}' for r in rates)} | {statistics.median(rates):.1f} | "
              f"{statistics.median(rates) / off:.3f} |")
    print(f"probe step-time cost: {100 * (off / statistics.median(arms['probe']) - 1):+.1f}% "
          f"(A/A: {100 * (off / statistics.median(arms['off again']) - 1):+.1f}%), load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
