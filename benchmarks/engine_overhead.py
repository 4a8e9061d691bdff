"""Engine overhead: step time of autotuner's Engine vs. the same loop in plain PyTorch, per ZeRO stage.

Run as the rank program (2 gloo ranks, OMP_NUM_THREADS=1 each):

    python -m autotuner --nproc_per_node 2 benchmarks/engine_overhead.py [--steps 10 --warmup 2 --repeats 10]

For each stage both variants are built from the same initial weights and train on the same batches.
Blocks alternate plain, engine, plain, engine, ...; every block starts after gc and a barrier, runs
`--warmup` untimed steps, then `--steps` timed ones. A step's time is the slowest rank's time for it;
the reported number is the median over all timed steps of a variant. Rank 0 prints a markdown table
and writes the CSV. fp32, gradient accumulation 1, no clipping, no scheduler on both sides.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autotuner
from autotuner.runtime.distributed import init_distributed

LR, WEIGHT_DECAY = 1e-3, 0.01
DEFAULT_CSV = Path(__file__).resolve().parent / "results" / "engine_overhead.csv"


class MLP(nn.Module):
    """Residual MLP; the blocks sit in a ModuleList so the engine shards each one under FSDP2."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


# ----- the plain-PyTorch side, wrapped exactly as autotuner/runtime/training/sharding.py wraps it -----
def plain_model_and_optimizer(model: nn.Module, stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if stage <= 1:
        wrapped = DistributedDataParallel(model)  # CPU: device_ids=None, default buckets (as zero.py)
        if stage == 0:
            return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            list(wrapped.parameters()), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY
        )
        return wrapped, optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = dict(mesh=mesh, reshard_after_forward=stage == 3, mp_policy=MixedPrecisionPolicy(),
                  offload_policy=OffloadPolicy())
    for module in model.modules():  # every ModuleList entry is its own unit, then the root
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def make_plain_step(model: nn.Module, stage: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    wrapped, optimizer = plain_model_and_optimizer(model, stage)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_engine_step(model: nn.Module, stage: int, micro_batch: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,  # keep the progress line out of the timings and the output
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = autotuner.initialize(model=model, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    return step


# ----- timing -----
def machine_busy_s() -> float:
    """CPU seconds all processes on this machine have used (Linux /proc/stat); NaN elsewhere."""
    try:
        with open("/proc/stat") as handle:
            ticks = [int(v) for v in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def run_block(step: Callable, batches: list, warmup: int, steps: int, offset: int) -> tuple[list[float], float]:
    """Untimed warm-up, then `steps` timed steps. Returns the per-step seconds (slowest rank per step)
    and the cores that other processes kept busy meanwhile: on 2 cores any of it inflates the steps."""
    gc.collect()
    dist.barrier()
    for i in range(warmup):
        step(*batches[(offset + i) % len(batches)])
    times = []
    busy, own, wall = machine_busy_s(), time.process_time(), time.perf_counter()
    for i in range(steps):
        x, y = batches[(offset + warmup + i) % len(batches)]
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    busy, own, wall = machine_busy_s() - busy, time.process_time() - own, time.perf_counter() - wall
    # A synchronous data-parallel step is done only when every rank is; all ranks share this machine.
    per_step = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    ours = torch.tensor([own], dtype=torch.float64)
    dist.all_reduce(ours)
    return per_step.tolist(), max(0.0, busy - ours.item()) / max(wall, 1e-9)


def bench_stage(stage: int, base: nn.Module, batches: list, args: argparse.Namespace) -> dict:
    steps = {"plain": make_plain_step(copy.deepcopy(base), stage)}
    if args.control:  # A/A check: a second plain copy in the engine's slot shows the noise floor
        steps["engine"] = make_plain_step(copy.deepcopy(base), stage)
    else:
        steps["engine"] = make_engine_step(copy.deepcopy(base), stage, args.batch)
    for name, step in steps.items():  # first steps: lazy init, DDP bucket rebuild, optimizer state
        run_block(step, batches, args.warmup, 0, 0)
    times: dict[str, list[float]] = {name: [] for name in steps}
    block_medians: dict[str, list[float]] = {name: [] for name in steps}
    other_cores: list[float] = []
    for repeat in range(args.repeats):
        for name, step in steps.items():  # interleaved: plain, engine, plain, engine, ...
            block, other = run_block(step, batches, args.warmup, args.steps, repeat * args.steps)
            times[name] += block
            block_medians[name].append(statistics.median(block))
            other_cores.append(other)
    plain_ms, engine_ms = (statistics.median(times[name]) * 1e3 for name in ("plain", "engine"))
    ms = lambda seconds: round(seconds * 1e3, 3)  # noqa: E731
    return {
        "stage": stage,
        "plain_ms": round(plain_ms, 3),
        "engine_ms": round(engine_ms, 3),
        "ratio": round(engine_ms / plain_ms, 4),
        "plain_block_min_ms": ms(min(block_medians["plain"])),
        "plain_block_max_ms": ms(max(block_medians["plain"])),
        "engine_block_min_ms": ms(min(block_medians["engine"])),
        "engine_block_max_ms": ms(max(block_medians["engine"])),
        "other_cpu_cores": round(statistics.fmean(other_cores), 3),
        "timed_steps_per_variant": len(times["plain"]),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| stage | plain ms | engine ms | ratio | plain block medians ms | engine block medians ms | other load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['plain_ms']:.2f} | {r['engine_ms']:.2f} | {r['ratio']:.3f} "
            f"| {r['plain_block_min_ms']:.1f}-{r['plain_block_max_ms']:.1f} "
            f"| {r['engine_block_min_ms']:.1f}-{r['engine_block_max_ms']:.1f} | {r['other_cpu_cores']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    parser.add_argument("--repeats", type=int, default=10, help="blocks per variant and stage")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="micro-batch per rank")
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--control", action="store_true", help="time plain against plain (noise floor)")
    args = parser.parse_args()

    # torch reads OMP_NUM_THREADS at start-up; set it again so a hand-launched run matches the launcher.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = init_distributed()
    torch.manual_seed(0)
    base = MLP(args.width, args.depth)  # same initial weights on every rank and for both variants
    data = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own shard, as a sampler gives
    batches = [
        (torch.randn(args.batch, args.width, generator=data), torch.randn(args.batch, 1, generator=data))
        for _ in range(16)
    ]
    if ctx.rank == 0:
        params = sum(p.numel() for p in base.parameters())
        print(
            f"engine_overhead: world {ctx.world_size} ({ctx.backend}), threads/rank {torch.get_num_threads()}, "
            f"MLP width {args.width} depth {args.depth} ({params / 1e6:.2f} M params), batch {args.batch}/rank, "
            f"{args.repeats} x {args.steps} timed steps per variant (+{args.warmup} warm-up per block)",
            flush=True,
        )
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        started = time.perf_counter()
        rows.append(bench_stage(stage, base, batches, args))
        if ctx.rank == 0:
            r = rows[-1]
            print(f"stage {stage}: plain {r['plain_ms']:.2f} ms, engine {r['engine_ms']:.2f} ms, "
                  f"ratio {r['ratio']:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    if ctx.rank == 0:
        print("\n" + markdown(rows))
        print("\nother load: cores kept busy by other processes during the timed steps; above ~0.1 on a "
              "2-core machine the numbers are contaminated, rerun when it is quiet.")
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {args.csv}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
