"""An `accelerate launch`-style script: accelerate's Accelerator with its DeepSpeed plugin, given
the config as `--deepspeed PATH` (as Hugging Face's Trainer takes it), never importing deepspeed
or autotuner itself. The tuner must find DeepSpeed's engine behind it and measure it there.
"""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator, DeepSpeedPlugin
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed, gradient_accumulation_steps=args.gradient_accumulation_steps)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.steps
    data = TensorDataset(torch.randn(samples, 32), torch.randn(samples, 1))
    loader = DataLoader(data, batch_size=args.per_device_train_batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.print(f"trained {args.steps} steps; last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
