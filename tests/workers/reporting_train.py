"""Rank program for the reporting tests: trains a small block model with `import autotuner as
deepspeed` on the config given, then reports what the engine exposes.

    launcher --nproc_per_node 2 tests/workers/reporting_train.py --steps 6 --out r.json --deepspeed ds.json
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import autotuner as deepspeed

WIDTH, BATCH_IN = 32, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(BATCH_IN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save16", default=None, help="save_16bit_model into this folder at the end")
    parser.add_argument("--custom_event", action="store_true", help="engine.monitor.write_events of our own")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--gradient_offset", type=float, default=0.0,
                        help="adds this to every gradient element (a large one makes fp16 sums overflow)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)  # the same initial weights on every rank and every run
    model = Net()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = dist.get_rank()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(args.steps):
        for m in range(gas):
            generator = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
            x, y = torch.randn(micro, BATCH_IN, generator=generator), torch.randn(micro, 1, generator=generator)
            loss = nn.functional.mse_loss(engine(x), y)
            if args.gradient_offset:
                loss = loss + args.gradient_offset * sum(p.sum() for p in model.parameters())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if args.custom_event:
            engine.monitor.write_events([("Custom/step_loss", losses[-1], engine.global_samples)])
    saved = engine.save_16bit_model(args.save16) if args.save16 else None
    weights = {name: p.full_tensor().tolist() if hasattr(p, "full_tensor") else p.tolist()
               for name, p in engine.module.named_parameters()}
    wandb_summary = None
    if rank == 0 and engine.config.wandb.enabled:
        import wandb  # wandb's own record of what this run logged

        wandb.run.log({}, commit=True)  # wandb holds the last step open until the step changes or the run ends
        wandb_summary = {key: value for key, value in dict(wandb.run.summary).items() if not key.startswith("_")}
    engine.destroy()  # DeepSpeedExamples' scripts end so; the monitors close
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "weights": weights, "saved": saved,
                       "avg_samples_per_sec": engine.tput_timer.avg_samples_per_sec(),
                       "timers": engine.get_wall_clock_timers(), "global_samples": engine.global_samples,
                       "train_batch_size": engine.train_batch_size(), "monitor_enabled": engine.monitor.enabled,
                       "wandb_summary": wandb_summary},
                      handle)


if __name__ == "__main__":
    main()
