"""A small ConvNet on synthetic 32x32 images, for the tuning-quality benchmark.

    launcher --nproc_per_node 2 benchmarks/workloads/convnet.py --micro_batch_size 16 --deepspeed ds.json
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import autotuner
from autotuner.config import fill_auto


class ConvNet(nn.Module):
    def __init__(self, channels: int = 64, blocks: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro_batch_size", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (as DeepSpeed's does)")
    autotuner.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = fill_auto(args.deepspeed_config or args.deepspeed, {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    })
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(4096, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (4096,), generator=generator)
    engine, _, loader, _ = autotuner.initialize(model=ConvNet(args.channels), config=config,
                                                training_data=TensorDataset(images, labels))
    epoch = 0
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(engine(x.to(engine.device)).float(), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    if engine.global_rank == 0:
        print(f"done: {engine.global_steps} steps, loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
