"""A communication-heavy DDP workload for the online-tuning benchmark: many small layers, a tiny
micro-batch, so the gradient all-reduce (and how it is bucketed) weighs on every step.

    launcher --nproc_per_node 2 benchmarks/workloads/wide_mlp.py --steps 60 --timings_out t.json --deepspeed ds.json
"""

import argparse
import json
import time

import torch
import torch.nn as nn

import autotuner


class WideMLP(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the timings (warmup)")
    parser.add_argument("--timings_out", default=None, help="rank 0 writes samples/s after --skip steps here")
    parser.add_argument("--local_rank", type=int, default=-1)
    autotuner.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    engine, *_ = autotuner.initialize(model=WideMLP(args.width, args.layers), config=args.deepspeed)
    micro = engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(engine.global_rank)
    batches = [(torch.randn(micro, args.width, generator=generator).to(engine.device),
                torch.randn(micro, 1, generator=generator).to(engine.device)) for _ in range(16)]
    started = None
    for step in range(args.steps):
        if step == args.skip:
            started = time.perf_counter()
        for micro_step in range(engine.gradient_accumulation_steps()):
            x, y = batches[(step + micro_step) % len(batches)]
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    elapsed = time.perf_counter() - started
    if engine.global_rank == 0 and args.timings_out:
        samples = engine.train_batch_size() * (args.steps - args.skip)
        with open(args.timings_out, "w") as handle:
            json.dump({"samples_per_s": samples / elapsed, "knobs": engine.applied_knobs()}, handle)


if __name__ == "__main__":
    main()
