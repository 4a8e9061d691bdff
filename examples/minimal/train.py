"""Minimal training script on the DeepSpeed-style API: a small MLP regresses a fixed random teacher.

    launcher --nproc_per_node 2 examples/minimal/train.py --deepspeed configs/zero2.json
"""

import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import autotuner
from autotuner.config import fill_auto


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, inputs: int = 32):
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def teacher_dataset(samples: int, inputs: int = 32, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, inputs, generator=generator)
    w = torch.randn(inputs, 1, generator=generator) / inputs**0.5
    y = torch.tanh(x @ w) + 0.01 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--micro_batch_size", type=int, default=None, help="fills train_micro_batch_size_per_gpu: auto")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--losses_out", default=None, help="rank 0 writes the loss of each step here (JSON)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (as DeepSpeed's does)")
    autotuner.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = fill_auto(
        args.deepspeed_config or args.deepspeed,
        {
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
        },
    )
    engine, _, loader, _ = autotuner.initialize(
        model=MLP(args.width, args.depth), config=config, training_data=teacher_dataset(8192)
    )
    losses, step_loss, epoch = [], 0.0, 0
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            step_loss += loss.item() / engine.gradient_accumulation_steps()
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                losses.append(step_loss)
                step_loss = 0.0
                if engine.global_steps % engine.config.steps_per_print == 0 and engine.global_rank == 0:
                    print(f"step {engine.global_steps}: loss {losses[-1]:.4f}", flush=True)
                if engine.global_steps >= args.steps:
                    break
        epoch += 1
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if engine.global_rank == 0:
        print(f"done: {engine.global_steps} steps, first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
        if args.losses_out:
            with open(args.losses_out, "w") as handle:
                json.dump(losses, handle)


if __name__ == "__main__":
    main()
