"""Samples to a target loss against the global batch, with the learning rate tuned at each batch
(issue 50): does E(B) = E_min (1 + B / B_noise), the model the goodput metric scores with, hold?

    python benchmarks/sample_efficiency.py [--hidden 256] [--batches 32,128,512,2048]
                                           [--lrs 0.0005,...] [--seeds 2] [--optimizer AdamW]

McCandlish et al.'s model of the samples a run needs assumes the learning rate is the best one
for each batch. The goodput benchmark (goodput.py) instead scales one learning rate, chosen for
the reference batch, by a rule (linear or sqrt); there the sqrt rows contradicted the model. Here
each batch gets a grid of learning rates, and the best one's samples to the target are kept:
1. one process, the label-noise task of benchmarks/workloads/label_noise.py (fresh samples every
   step, the held-out set and the target as in goodput.py: the label noise's floor + 0.25);
2. for each batch, learning rate and seed: train from the seed's initial weights until the
   held-out loss is at the target (evaluated every --eval_every samples, or every step if the
   batch is larger), or --max_samples, or a loss that is not finite, or --patience samples
   without a better held-out loss (a plateau above the target);
3. per batch, the learning rate with the fewest samples (median over seeds);
4. E_min and B_crit fitted to E(B) = E_min (1 + B / B_crit) (least squares on relative errors),
   and B_noise measured directly (per-sample gradients, goodput.py's `direct_noise_scale`) at
   initialisation and after 3 steps at the reference batch, for comparison.
Results: benchmarks/results/sample_efficiency.csv (every run) and a markdown table on stdout.
Nothing is launched: the question is statistical, so time is not measured.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "workloads"))
from goodput import direct_noise_scale, target_loss  # noqa: E402
from label_noise import Task, make_model  # noqa: E402

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)}


def samples_to_target(task: Task, args: argparse.Namespace, batch: int, lr: float, seed: int,
                      target: float) -> int | None:
    """Fresh samples drawn until the held-out loss is at `target`; None if not reached."""
    torch.manual_seed(seed)
    model = make_model(args.features, args.classes, args.hidden)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed * 1000)
    eval_x, eval_y = task.held_out(8192, 0)
    every = max(batch, args.eval_every)
    samples, next_eval, best, best_at = 0, every, math.inf, 0
    while samples < args.max_samples:
        x, y = task.draw(batch, generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        samples += batch
        if samples >= next_eval:
            next_eval += every
            with torch.no_grad():
                held_out = F.cross_entropy(model(eval_x), eval_y).item()
            if not math.isfinite(held_out):
                return None
            if held_out <= target:
                return samples
            if held_out < best - 1e-3:
                best, best_at = held_out, samples
            elif samples - best_at >= args.patience:
                return None  # a plateau above the target: too high a rate for this batch
    return None


def fit_critical_batch(batches: list[int], samples: list[float]) -> tuple[float, float]:
    """(E_min, B_crit) of E(B) = E_min + (E_min / B_crit) B, weighted by 1/E (relative errors)."""
    b, e = np.array(batches, dtype=float), np.array(samples, dtype=float)
    weights = 1.0 / e
    design = np.stack([np.ones_like(b), b], axis=1) * weights[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(design, e * weights, rcond=None)
    return float(intercept), float(intercept / slope) if slope > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label_noise", type=float, default=0.1)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="AdamW")
    parser.add_argument("--batches", default="32,128,512,2048")
    parser.add_argument("--lrs", default="0.0005,0.001,0.002,0.004,0.008,0.016,0.032")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--target_over_floor", type=float, default=0.25)
    parser.add_argument("--eval_every", type=int, default=4096)
    parser.add_argument("--max_samples", type=int, default=2_000_000)
    parser.add_argument("--patience", type=int, default=200_000,
                        help="samples without a better held-out loss before a run counts as not reaching it")
    parser.add_argument("--reference_batch", type=int, default=32, help="for the direct B_noise after 3 steps")
    parser.add_argument("--csv", default=str(RESULTS / "sample_efficiency.csv"))
    args = parser.parse_args()
    task = Task(args.features, args.classes, args.label_noise, 0)
    target = target_loss(args.label_noise, args.classes, args.target_over_floor)
    direct_args = argparse.Namespace(seed_for_direct=1, features=args.features, classes=args.classes,
                                     hidden=args.hidden, lr=1e-3, reference_batch=args.reference_batch,
                                     direct_samples=4096)
    direct = {steps: direct_noise_scale(task, direct_args, steps) for steps in (0, 3)}
    print(f"hidden {args.hidden}, label noise {args.label_noise}, {args.optimizer}, target {target}; direct B_noise "
          f"{direct[0]:.0f} at initialisation, {direct[3]:.0f} after 3 steps", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for lr in (float(v) for v in args.lrs.split(",")):
            for seed in range(1, args.seeds + 1):
                reached = samples_to_target(task, args, batch, lr, seed, target)
                rows.append({"hidden": args.hidden, "label_noise": args.label_noise, "optimizer": args.optimizer,
                             "target_loss": target, "batch": batch, "lr": lr, "seed": seed, "samples": reached})
                print(f"  batch {batch} lr {lr:g} seed {seed}: "
                      + (f"{reached} samples" if reached else "not reached"), flush=True)
    table = pd.DataFrame(rows)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    if Path(args.csv).exists():
        old = pd.read_csv(args.csv)
        same = (old.hidden == args.hidden) & (old.label_noise == args.label_noise) & (old.optimizer == args.optimizer)
        table = pd.concat([old[~same], table], ignore_index=True)
    table.to_csv(args.csv, index=False)
    runs = pd.DataFrame(rows)
    best = []
    for batch, group in runs.groupby("batch"):
        medians = {lr: statistics.median(g.samples) for lr, g in group.groupby("lr") if g.samples.notna().all()}
        if medians:
            lr = min(medians, key=medians.get)
            best.append({"batch": batch, "best lr": lr, "samples (median)": int(medians[lr]),
                         "lrs reaching the target": len(medians)})
    frame = pd.DataFrame(best)
    e_min, b_crit = fit_critical_batch(list(frame["batch"]), list(frame["samples (median)"]))
    frame["model E_min (1 + B/B_crit)"] = [int(e_min * (1 + b / b_crit)) for b in frame["batch"]]
    print(frame.to_markdown(index=False))
    print(f"fit: E_min {e_min:.0f} samples, B_crit {b_crit:.0f}; direct B_noise {direct[0]:.0f} at initialisation, "
          f"{direct[3]:.0f} after 3 steps")


if __name__ == "__main__":
    main()
