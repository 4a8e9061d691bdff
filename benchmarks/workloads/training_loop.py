"""What the tuning benchmarks' workloads share: the flags the tuner maps, the config with its
"auto" batch keys filled from them, and the training loop over a dataset (the script's own
DataLoader from autotuner.initialize, re-shuffled each epoch), through the public API only."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

import autotuner
from autotuner.config import fill_auto

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def workload_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags every workload takes: the batch keys the tuner maps, the steps, DeepSpeed's."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro_batch_size", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (as DeepSpeed's does)")
    autotuner.add_config_arguments(parser)
    return parser


def train(args: argparse.Namespace, model: nn.Module, data: Dataset, loss_of: Loss) -> None:
    """Train `model` on `data` for `args.steps` optimizer steps; rank 0 prints the last loss."""
    config = fill_auto(args.deepspeed_config or args.deepspeed, {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    })
    engine, _, loader, _ = autotuner.initialize(model=model, config=config, training_data=data)
    loss = train_engine(engine, loader, args.steps, loss_of)
    if engine.global_rank == 0:
        print(f"done: {engine.global_steps} steps, loss {loss.item():.3f}")


def train_engine(engine, loader, steps: int, loss_of: Loss) -> torch.Tensor:
    """`steps` optimizer steps over (input, target) batches; returns the last loss."""
    return train_batches(engine, loader, steps,
                         lambda batch: loss_of(engine(batch[0].to(engine.device)).float(), batch[1].to(engine.device)))


def train_batches(engine, loader, steps: int, batch_loss: Callable[[object], torch.Tensor]) -> torch.Tensor:
    """`steps` optimizer steps of a DeepSpeed-style engine (ours or DeepSpeed's) over its loader,
    re-shuffled each epoch, each batch's loss from `batch_loss`; returns the last loss."""
    epoch, loss = 0, None
    while engine.global_steps < steps:
        # Ours exposes the DistributedSampler as .sampler; DeepSpeed's loader as .data_sampler.
        sampler = getattr(loader, "sampler", None) or getattr(loader, "data_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = batch_loss(batch)
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= steps:
                break
        epoch += 1
    return loss


def engine_parser(description: str | None) -> tuple[argparse.ArgumentParser, str]:
    """For a workload that runs under either engine: a parser with --engine and --local_rank, and
    the engine --engine names (read first: DeepSpeed's and our config flags differ)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", choices=("deepspeed", "autotuner"), default="autotuner")
    engine_name = pre.parse_known_args()[0].engine
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("deepspeed", "autotuner"), default="autotuner")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))  # deepspeed's launcher
    return parser, engine_name


def engine_module(engine_name: str):
    """The module whose initialize() and add_config_arguments() the workload uses."""
    return importlib.import_module(engine_name)


def parse_engine_args(parser: argparse.ArgumentParser, engine_name: str) -> argparse.Namespace:
    """The workload's own flags, then the engine's config flags."""
    module = engine_module(engine_name)
    if engine_name == "deepspeed":
        parser = module.add_config_arguments(parser)  # DeepSpeed's returns the parser
    else:
        module.add_config_arguments(parser)
    return parser.parse_args()
