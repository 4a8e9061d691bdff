"""What reading the gradient noise costs a training step (issue 70: below 2% on the GPT-2 example).

The batch ramp (autotuning.adapt_batch) keeps the goodput probe on through training: a DDP
communication hook reading each bucket's squared norm before and after the all-reduce, one scalar
all-reduce at each accumulation boundary, and rank 0's smoothed estimate. This benchmark trains the
GPT-2 example's model (tiny preset, sequence 128, micro-batch 4 x gas 8, ZeRO 0: the README's
pick) in one process per rank, as three engines built from the same weights:

- off: the engine as the example's config builds it;
- probe: the same config with adapt_batch on and a plan whose interval never changes the batch, so
  only the reading differs;
- off again: a second "off" engine, the A/A control: its ratio to "off" is the noise floor the
  probe's ratio must stand out of.

Blocks of optimizer steps alternate between the three (the order rotated each round), so drift
through the sitting falls on every arm alike. A step's time is the slowest rank's; an arm's figure
is the median over its timed steps. Run alone on the machine, as the rank program:

    python -m autotuner --nproc_per_node 2 benchmarks/noise_probe_cost.py [--repeats 12 --steps 4]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist

import autotuner
from autotuner.runtime.distributed import init_distributed

MICRO, GAS, SEQ, VOCAB = 4, 8, 128, 4096
ARMS = ("off", "probe", "off again")


def gpt2_tiny() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the same weights on every rank and in every arm
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
    return GPT2LMHeadModel(config)


def engine_config(plan: Path | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,  # keep the progress line out of the timings
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
    }
    if plan is not None:
        config["autotuning"] = {"adapt_batch": True, "adapt_interval": 10**9, "metric": "goodput",
                                "reference_batch_size": MICRO * GAS * dist.get_world_size(),
                                "lr_scaling": "none", "adapt_plan": str(plan)}
    return config


def write_plan(work: Path) -> Path:
    """A plan with one micro-batch and an interval past the run: the ramp reads, never changes."""
    plan = work / "plan.json"
    plan.write_text(json.dumps({"reference_batch": MICRO * GAS * dist.get_world_size(), "lr_scaling": "none",
                                "interval": 10**9,
                                "costs": [{"micro_batch_size": MICRO, "micro_step_s": 1.0, "step_s": 0.0}],
                                "csv_path": "", "initial_b_noise": None}))
    return plan


def make_step(engine, batches: list[torch.Tensor]):
    def step(offset: int) -> None:
        for i in range(GAS):
            tokens = batches[(offset * GAS + i) % len(batches)]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()

    return step


def run_block(step, first: int, warmup: int, steps: int) -> list[float]:
    """Untimed warm-up, then `steps` timed optimizer steps; each step's time is the slowest rank's."""
    gc.collect()
    dist.barrier()
    for i in range(warmup):
        step(first + i)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(first + warmup + i)
        times.append(time.perf_counter() - start)
    per_step = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    return per_step.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps before each block")
    parser.add_argument("--repeats", type=int, default=12, help="blocks per arm")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = init_distributed()
    data = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own shard, as a sampler gives
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=data) for _ in range(64)]
    base = gpt2_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        plan = write_plan(Path(tmp)) if ctx.rank == 0 else None
        shared = [str(plan) if plan else None]
        dist.broadcast_object_list(shared, src=0)  # one plan file, rank 0's temporary directory
        engines = {}
        for arm in ARMS:
            engine, _, _, _ = autotuner.initialize(
                model=copy.deepcopy(base), config=engine_config(Path(shared[0]) if arm == "probe" else None))
            engines[arm] = engine
        if engines["probe"]._ramp is None or engines["off"]._ramp is not None:
            raise SystemExit("noise_probe_cost: the probe arm did not build the batch ramp's reading")
        steps = {arm: make_step(engine, batches) for arm, engine in engines.items()}
        for arm in ARMS:  # first steps: DDP's bucket rebuild, the optimizer's state
            run_block(steps[arm], 0, 2, 0)
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        blocks: dict[str, list[float]] = {arm: [] for arm in ARMS}
        started = time.perf_counter()
        for repeat in range(args.repeats):
            order = ARMS[repeat % 3:] + ARMS[:repeat % 3]
            for arm in order:
                block = run_block(steps[arm], repeat * (args.steps + args.warmup), args.warmup, args.steps)
                times[arm] += block
                blocks[arm].append(statistics.median(block))
        readings = engines["probe"]._ramp.estimator.steps  # the ramp takes the probe's pairs each step
        if ctx.rank == 0:
            off = statistics.median(times["off"])
            print(f"noise_probe_cost: GPT-2 tiny (2 x 128, vocab {VOCAB}), sequence {SEQ}, {ctx.world_size} ranks "
                  f"({ctx.backend}), micro-batch {MICRO} x gas {GAS}, ZeRO 0, {args.repeats} blocks x {args.steps} "
                  f"timed steps per arm, {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}, "
                  f"noise readings in the probe arm: {readings}")
            print("| arm | median step ms | block medians ms | ratio to off |\n|---|---|---|---|")
            for arm in ARMS:
                median = statistics.median(times[arm])
                print(f"| {arm} | {median * 1e3:.1f} | {min(blocks[arm]) * 1e3:.1f}-{max(blocks[arm]) * 1e3:.1f} "
                      f"| {median / off:.3f} |")
            probe = statistics.median(times["probe"]) / off - 1
            control = statistics.median(times["off again"]) / off - 1
            print(f"probe step-time cost: {100 * probe:+.1f}% (A/A control: {100 * control:+.1f}%)")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
