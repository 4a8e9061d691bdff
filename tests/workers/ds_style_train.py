"""A training script written the way DeepSpeedExamples' scripts are, with only the import changed
(`import autotuner as deepspeed`). It uses the API those scripts use: `--local_rank` declared by
the script (before or after add_config_arguments), init_distributed, get_accelerator, the comm
module, runtime.utils.set_random_seed, a client FusedAdam beside the config's optimizer section,
a callable scheduler, a positional initialize(...) with training_data, RepeatingLoader, log_dist
and the engine's members. Rank 0 writes what it saw to --out.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import autotuner as deepspeed
from autotuner import comm as dist
from autotuner.accelerator import get_accelerator
from autotuner.ops.adam import FusedAdam
from autotuner.runtime.utils import set_random_seed
from autotuner.utils import RepeatingLoader, log_dist


def parse_args() -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --local_rank=0 is no prefix of it
    pre.add_argument("--local_rank_after", action="store_true")
    order = pre.parse_known_args()[0]
    parser = argparse.ArgumentParser(description="DeepSpeedExamples-style script")
    parser.add_argument("--local_rank_after", action="store_true", help="declare --local_rank after the config flags")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    if not order.local_rank_after:
        parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    if order.local_rank_after:
        parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = get_accelerator()
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    set_random_seed(1234)
    accelerator.manual_seed(1234)

    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(256, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    dataset = TensorDataset(inputs, targets)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = FusedAdam(model.parameters(), lr=1e-2)

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    # Positional, in DeepSpeed's order: args, model, optimizer, model_parameters, training_data, lr_scheduler.
    engine, engine_optimizer, loader, scheduler = deepspeed.initialize(args, model, optimizer, None, dataset, schedule)
    device = torch.device(accelerator.device_name(engine.local_rank))
    losses, norms, applied = [], [], []
    for step, (x, y) in enumerate(RepeatingLoader(loader)):
        if step >= args.steps * engine.gradient_accumulation_steps():
            break
        # As DeepSpeed scripts do under fp16: the loss in fp32 from a half-precision output.
        loss = nn.functional.mse_loss(engine(x.to(device)).float(), y.to(device))
        engine.backward(loss)
        engine.step()
        accelerator.synchronize()
        if engine.was_step_applied():
            norms.append(engine.get_global_grad_norm())
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        applied.append(engine.was_step_applied())
    log_dist(f"trained {len(losses)} steps", ranks=[0])
    dist.barrier()
    if dist.get_rank() == 0 and args.out:
        seen = {
            "losses": losses,
            "grad_norms": norms,
            "step_applied": applied,
            "local_rank_arg": args.local_rank,
            "local_rank_env": int(os.environ["LOCAL_RANK"]),
            "comm_local_rank": dist.get_local_rank(),
            "world_size": dist.get_world_size(),
            "stage": engine.zero_optimization_stage(),
            "fp16": engine.fp16_enabled(),
            "bf16": engine.bfloat16_enabled(),
            "lr": engine.get_lr(),
            "scheduler": type(scheduler).__name__,
            "optimizer": type(engine_optimizer).__name__,
            "loader_batch": loader.batch_size,
            "module_is_model": engine.module is model,
            "device_name": accelerator.device_name(),
            "device_count": accelerator.device_count(),
            "memory_allocated": accelerator.memory_allocated(),
            "max_memory_allocated": accelerator.max_memory_allocated(),
            "is_available": accelerator.is_available(),
        }
        with open(args.out, "w") as handle:
            json.dump(seen, handle)


if __name__ == "__main__":
    main()
