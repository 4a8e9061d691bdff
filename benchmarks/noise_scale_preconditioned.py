"""Issue 50's next idea, checked before it is built: is Adam's preconditioned noise scale large
enough to explain why sqrt-scaled AdamW keeps its sample efficiency far past B_noise?

    python benchmarks/noise_scale_preconditioned.py [--hidden 1024] [--label_noise 0.1] [--samples 4096]

The goodput benchmark's workload (benchmarks/workloads/label_noise.py: an MLP on a noisy linear
teacher, AdamW at lr 1e-3 and batch 32, fresh samples each step), one process. After k AdamW steps
(k = 1, 3, 10, 30, 100, 300) both noise scales are measured directly from per-sample gradients
(torch.func) over --samples fresh samples, unbiased as in benchmarks/goodput.py:
- simple: tr(Sigma) / |G|^2 (McCandlish et al.);
- preconditioned: tr(P Sigma) / G^T P G with P = 1 / (sqrt(v_hat) + eps), v_hat AdamW's
  bias-corrected second moment at that step (Pollux, OSDI'21, section 3.1, for Adam).
The goodput benchmark's sqrt rows need a noise scale of several thousand to make batch 2048 cost
only 1.06-1.45x the samples of batch 512; this prints what each definition gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent / "workloads"))
from label_noise import Task, make_model  # noqa: E402

BETA2, EPS = 0.999, 1e-8  # AdamW's defaults, as the workload runs it


def noise_scales(model: torch.nn.Module, optimizer: torch.optim.Optimizer, task: Task, samples: int,
                 generator: torch.Generator) -> tuple[float, float | None]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    states = [optimizer.state[p] for p in model.parameters()]
    precondition = None
    if states[0]:
        step = float(states[0]["step"])
        precondition = torch.cat([(1.0 / ((s["exp_avg_sq"] / (1 - BETA2 ** step)).sqrt() + EPS)).reshape(-1)
                                  for s in states]).double()
    per_sample = vmap(grad(lambda p, x, y: F.cross_entropy(functional_call(model, p, (x[None],)), y[None])),
                      in_dims=(None, 0, 0))
    total, total_sq, total_psq, n = None, 0.0, 0.0, 0
    for _ in range(samples // 512):
        x, y = task.draw(512, generator)
        gradients = per_sample(params, x, y)
        flat = torch.cat([gradients[name].reshape(512, -1) for name in params], dim=1).double()
        total = flat.sum(0) if total is None else total + flat.sum(0)
        total_sq += float((flat * flat).sum())
        if precondition is not None:
            total_psq += float((flat * flat * precondition).sum())
        n += 512
    mean = total / n

    def ratio(sum_sq: float, mean_sq: float) -> float:
        trace = (sum_sq / n - mean_sq) * n / (n - 1)
        return trace / (mean_sq - trace / n)

    simple = ratio(total_sq, float(mean @ mean))
    return simple, (ratio(total_psq, float(mean * mean @ precondition)) if precondition is not None else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--label_noise", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--reference_batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    task = Task(32, 10, args.label_noise, 0)
    model = make_model(32, 10, args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(12345)
    print(f"hidden {args.hidden}, label noise {args.label_noise}, {args.samples} samples per measurement")
    print("| AdamW steps | simple B_noise | preconditioned B_noise | ratio |")
    print("|---:|---:|---:|---:|")
    done = 0
    for steps in (1, 3, 10, 30, 100, 300):
        while done < steps:
            x, y = task.draw(args.reference_batch, generator)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
        simple, preconditioned = noise_scales(model, optimizer, task, args.samples, generator)
        print(f"| {steps} | {simple:.0f} | {preconditioned:.0f} | {preconditioned / simple:.1f} |", flush=True)


if __name__ == "__main__":
    main()
