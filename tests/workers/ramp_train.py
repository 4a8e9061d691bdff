"""A training script whose global batch a batch ramp grows (autotuning.adapt_batch in its config,
the plan written by tests/integration/test_batch_ramp.py): a regression with a costly optimizer
step (one a larger accumulation count amortises), each rank's batches drawn from its step, micro-step
and rank, so a run resumed from a checkpoint sees the batches the uninterrupted one saw.

Writes to --out: ran.<rank>.json (per optimizer step: gas, learning rate, loss, the engine's
micro-batch, the rows of the batches it trained on), and with --save_at N a checkpoint after step N
(then stops); --load resumes from it. --use_deepspeed trains on DeepSpeed's own engine, through the
same calls; --engine_loader draws the batches from the loader the engine built (training_data),
each step's from the sampler's epoch set to the step, so a resumed run sees the same ones."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

import autotuner


class Samples(torch.utils.data.Dataset):
    """Regression samples, each drawn from its index: the same sample whatever the batch it falls in."""

    def __init__(self, teacher: torch.Tensor, count: int = 4096):
        self.teacher, self.count = teacher, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(16, generator=generator)
        return x, x @ self.teacher + 0.5 * torch.randn(1, generator=generator)


class SlowAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--use_deepspeed", action="store_true")
    parser.add_argument("--engine_loader", action="store_true")
    if "--use_deepspeed" in sys.argv:
        import deepspeed as api
    else:
        api = autotuner
    parser = api.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    engine, _, loader, _ = api.initialize(args=args, model=model, optimizer=SlowAdamW(model.parameters(), lr=1e-3),
                                          training_data=Samples(teacher) if args.engine_loader else None)
    checkpoint = os.path.join(args.out, "ckpt")
    ran = []
    if args.load:
        engine.load_checkpoint(checkpoint)
        with open(os.path.join(args.out, f"ran_saved.{engine.global_rank}.json")) as handle:
            ran = json.load(handle)  # the steps before the checkpoint
    while engine.global_steps < args.steps:
        step, gas, lr = engine.global_steps + 1, engine.gradient_accumulation_steps(), engine.get_lr()[0]
        micro = engine.train_micro_batch_size_per_gpu()
        total, rows = 0.0, set()
        if args.engine_loader:
            loader.sampler.set_epoch(step)
            batches = iter(loader)
        for index in range(gas):
            if args.engine_loader:
                x, y = next(batches)
            else:
                generator = torch.Generator().manual_seed(10_000 * step + 100 * index + engine.global_rank)
                x = torch.randn(micro, 16, generator=generator)
                y = x @ teacher + 0.5 * torch.randn(micro, 1, generator=generator)
            rows.add(len(x))
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        ran.append([gas, lr, total / gas, micro, sorted(rows)])
        if args.save_at and engine.global_steps == args.save_at:  # saved mid-run, training on
            engine.save_checkpoint(checkpoint)
            with open(os.path.join(args.out, f"ran_saved.{engine.global_rank}.json"), "w") as handle:
                json.dump(ran, handle)
    with open(os.path.join(args.out, f"ran.{engine.global_rank}.json"), "w") as handle:
        json.dump(ran, handle)


if __name__ == "__main__":
    main()
