"""A DeepSpeed AutoTP-style training script on our engine (only its import is ours): the config's
tensor_parallel.autotp_size splits the model, each rank draws its data-parallel slice of one
global batch by engine.get_data_parallel_rank(), as DeepSpeedExamples' AutoTP scripts shard it.

Writes to --out: losses.json (rank 0: the mean loss of each optimizer step), layout.json (every
rank: its ranks and how many parameters it holds), and with --save the whole model from
engine.save_16bit_model. --save_checkpoint / --load_checkpoint take a DCP checkpoint after (or
after --save_at steps, training on) or before the steps. Run under the launcher by tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autotuner as deepspeed  # noqa: E402  - the one line a DeepSpeed script changes
from tp_models import Net, llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("net", "llama"), default="net")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--save_checkpoint", default=None)
    parser.add_argument("--save_at", type=int, default=0, help="save --save_checkpoint after this many steps and "
                                                                "train on (0: after the last)")
    parser.add_argument("--load_checkpoint", default=None)
    parser.add_argument("--rank0_state_dict", action="store_true", help="rank 0 alone reads model.module.state_dict()")
    parser.add_argument("--unshared_batch", action="store_true", help="slice the data by global rank (a script's bug)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(1234 + dist.get_rank())  # the engine must start every rank from rank 0's weights
    model = Net() if args.model == "net" else llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before initialize, as DSE's scripts do
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
    if args.load_checkpoint:
        engine.load_checkpoint(args.load_checkpoint)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    if args.unshared_batch:
        dp, dp_rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(engine.global_steps, engine.global_steps + args.steps):
        total = 0.0
        for micro in range(gas):
            generator = torch.Generator().manual_seed(1000 * step + micro)
            ids = torch.randint(0, 50, (mbs * dp, 16), generator=generator)
            mine = ids[dp_rank * mbs:(dp_rank + 1) * mbs].to(engine.device)
            loss = (engine(mine, mine) if args.model == "net" else engine(input_ids=mine, labels=mine).loss)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().item()
        mean = torch.tensor(total / gas)
        dist.all_reduce(mean)  # TP ranks hold the same loss: the mean over all ranks is the mean over dp
        losses.append(mean.item() / dist.get_world_size())
        if args.save_checkpoint and args.save_at and len(losses) == args.save_at:
            engine.save_checkpoint(args.save_checkpoint)
    os.makedirs(args.out, exist_ok=True)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in engine.module.parameters())
    with open(os.path.join(args.out, f"layout{dist.get_rank()}.json"), "w") as handle:
        json.dump({"dp": engine.dp_world_size, "dp_rank": dp_rank, "tp": engine.mp_world_size,
                   "tp_rank": engine.get_tensor_parallel_rank(), "held": held,
                   "grad_norm": float(engine.get_global_grad_norm())}, handle)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "losses.json"), "w") as handle:
            json.dump(losses, handle)
    if args.save:
        engine.save_16bit_model(args.out)
    if args.save_checkpoint and not args.save_at:
        engine.save_checkpoint(args.save_checkpoint)
    if args.rank0_state_dict and dist.get_rank() == 0:
        torch.save(engine.module.state_dict(), os.path.join(args.out, "rank0.bin"))
    dist.barrier()


if __name__ == "__main__":
    main()
