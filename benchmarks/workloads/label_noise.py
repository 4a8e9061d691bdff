"""Classification with label noise, for the goodput benchmark (issue 50): a workload whose
gradient noise scale is small and known, trained online to a target held-out loss.

Each sample is x ~ N(0, I) with the class a fixed random linear teacher gives it; with
probability --label_noise the label is replaced by a uniform one. Every step draws fresh samples
(the online setting of McCandlish et al.), so the samples a run consumes is its step count times
its global batch. The held-out set is fixed by --data_seed; a run's draws and initial weights by
--seed.

    launcher --nproc_per_node 2 benchmarks/workloads/label_noise.py --micro_batch_size 8 \\
        --gradient_accumulation_steps 1 --target_loss 1.2 --result_out r.json --deepspeed ds.json

With --target_loss, every --eval_every samples rank 0 measures the held-out loss (the timer
paused) and every rank stops once it is at or below the target; --result_out then gets the
training time to it, the steps and the samples.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training_loop import workload_parser  # noqa: E402

import autotuner  # noqa: E402
from autotuner.config import fill_auto  # noqa: E402


class Task:
    """The data: a teacher over --features inputs and --classes classes, labels flipped at --label_noise."""

    def __init__(self, features: int, classes: int, label_noise: float, data_seed: int):
        self.features, self.classes, self.label_noise = features, classes, label_noise
        self.teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(data_seed))

    def draw(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(count, self.features, generator=generator)
        labels = (x @ self.teacher).argmax(dim=1)
        flipped = torch.rand(count, generator=generator) < self.label_noise
        noise = torch.randint(0, self.classes, (count,), generator=generator)
        return x, torch.where(flipped, noise, labels)

    def held_out(self, count: int, data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draw(count, torch.Generator().manual_seed(data_seed + 1))


def make_model(features: int, classes: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def parser():
    p = workload_parser(__doc__)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--label_noise", type=float, default=0.2)
    p.add_argument("--data_seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--target_loss", type=float, default=None)
    p.add_argument("--eval_every", type=int, default=16384, help="samples between held-out evaluations")
    p.add_argument("--eval_size", type=int, default=8192)
    p.add_argument("--result_out", default=None)
    return p


def main() -> None:
    args = parser().parse_args()
    task = Task(args.features, args.classes, args.label_noise, args.data_seed)
    torch.manual_seed(args.seed)
    model = make_model(args.features, args.classes, args.hidden)
    config = fill_auto(args.deepspeed_config or args.deepspeed, {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    })
    engine, *_ = autotuner.initialize(model=model, config=config)
    micro, first_batch = engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()
    generator = torch.Generator().manual_seed(args.seed * 1000 + engine.global_rank)
    eval_x, eval_y = task.held_out(args.eval_size, args.data_seed)
    training_s, next_eval, losses, reached = 0.0, args.eval_every, [], None
    started = time.perf_counter()
    while engine.global_steps < args.steps:
        for _ in range(engine.gradient_accumulation_steps()):  # read each step: a batch ramp may grow it
            x, y = task.draw(micro, generator)
            engine.backward(F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device)))
            engine.step()
        samples = engine.global_samples
        if args.target_loss is not None and samples >= next_eval:
            training_s += time.perf_counter() - started
            next_eval += args.eval_every
            with torch.no_grad():
                held_out = F.cross_entropy(engine.module(eval_x.to(engine.device)), eval_y.to(engine.device)).item()
            losses.append((samples, round(held_out, 4)))
            stop = torch.tensor([float(held_out <= args.target_loss)])
            if dist.is_initialized():
                dist.broadcast(stop, src=0)  # rank 0 decides: the ranks stop at the same step
            if stop.item():
                reached = {"training_s": training_s, "steps": engine.global_steps, "samples": samples,
                           "held_out_loss": held_out}
                break
            started = time.perf_counter()
    if engine.global_rank == 0:
        batch = engine.train_batch_size()
        print(f"done: {engine.global_steps} steps, global batch {first_batch}"
              + (f" -> {batch}" if batch != first_batch else "") + ", "
              + (f"target {args.target_loss} reached after {reached['samples']} samples in "
                 f"{reached['training_s']:.2f} s" if reached else "target not reached"))
        if args.result_out:
            with open(args.result_out, "w") as handle:
                json.dump({"micro_batch_size": micro, "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                           "first_global_batch": first_batch, "global_batch": batch,
                           "reached": reached, "held_out_losses": losses}, handle)


if __name__ == "__main__":
    main()
