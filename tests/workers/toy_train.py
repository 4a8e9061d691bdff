"""A training script with controllable memory, speed and faults, for autotuner tests.

Per micro-step it holds `--mem_per_sample_mb` MiB per sample (touched, so it is resident)
and sleeps `--ms_per_sample` ms per sample plus a fixed `--ms_per_step` per optimizer step,
so the throughput curve, and so the true optimum, is known in advance.
"""

import argparse
import importlib
import json
from importlib.util import find_spec
import multiprocessing
import os
import random
import signal
import sys
import time

import torch
import torch.nn as nn

import autotuner
from autotuner.config import fill_auto


def rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


class ChainBlock(nn.Module):
    """x + a chain of per-channel scales and GELUs: each link saves a sequence-sized tensor for
    backward, so activation checkpointing (which keeps only the block's input) saves most of them."""

    def __init__(self, width: int, links: int = 4):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(links, width))

    def forward(self, x):
        h = x
        for scale in self.scales:
            h = nn.functional.gelu(h * scale)
        return x + h


class ChainBlocks(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.ModuleList(ChainBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro_batch_size", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mem_per_sample_mb", type=float, default=0.0)
    parser.add_argument("--ms_per_sample", type=float, default=0.0)
    parser.add_argument("--ms_per_step", type=float, default=0.0)
    parser.add_argument("--ms_per_step_at", action="append", default=[], metavar="MICRO:MS",
                        help="--ms_per_step at this micro-batch (a fault test's one slow experiment)")
    parser.add_argument("--slow_above", type=int, default=0, help="micro-batches above this are 4x slower per sample")
    parser.add_argument("--fail_rank", type=int, default=-1, help="this rank raises at --fail_at_step")
    parser.add_argument("--fail_at_step", type=int, default=2)
    parser.add_argument("--kill_rank", type=int, default=-1, help="this rank SIGKILLs itself at --fail_at_step")
    parser.add_argument("--hang_at_step", type=int, default=0)
    parser.add_argument("--exit_at_step", type=int, default=0, help="exit 0 at this step, before any metrics")
    parser.add_argument("--fail_if_micro_batch_at_least", type=int, default=0)
    parser.add_argument("--fault_min_micro", type=int, default=0,
                        help="the injected faults above fire only when the micro-batch is at least this")
    parser.add_argument("--hang_once_file", default=None,
                        help="with --hang_at_step: hang only if this file does not exist yet (it is created)")
    parser.add_argument("--pid_dir", default=None, help="each rank writes its pid here")
    parser.add_argument("--echo_args_to", default=None, help="rank 0 writes sys.argv here")
    parser.add_argument("--echo_start_method_to", default=None,
                        help="rank 0 appends multiprocessing's start method here (what a DataLoader's workers use)")
    parser.add_argument("--loader_workers", type=int, default=0,
                        help="hold a DataLoader iterator with this many worker processes through the run "
                             "(DeepSpeed's own loader starts two per GPU)")
    parser.add_argument("--child_process", action="store_true",
                        help="start a process of our own that outlives this rank unless it is ended")
    parser.add_argument("--note", default=None, help="any string; ignored (tests that arguments pass unmangled)")
    parser.add_argument("--fault_at_micro", action="append", default=[], metavar="MICRO:FAULT",
                        help="fire FAULT (fail, kill, exit or hang) only at this micro-batch (repeatable); "
                             "when given, it replaces --fault_min_micro for every fault")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=0,
                        help="a model of this many repeated blocks (an nn.ModuleList) over a sequence of --seq_len "
                             "positions: elementwise chains whose activations, not their compute, dominate")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--ms_per_micro_step", type=float, default=0.0,
                        help="a fixed sleep per micro-step: larger micro-batches (fewer micro-steps) are faster")
    parser.add_argument("--segfault_if_forked", action="store_true",
                        help="rank 1 dies of SIGSEGV at step 2 when it was forked by multiprocessing (a warm launch)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (as DeepSpeed's does)")
    parser.add_argument("--lengths", default=None, metavar="MIN:MAX",
                        help="each step draws its batch's sequence length in MIN..MAX (dynamic padding); the memory "
                             "held per sample (--mem_per_sample_mb) is for --seq_len positions and scales with it")
    parser.add_argument("--late_length", type=int, default=0,
                        help="with --lengths: from --late_from_step on, every batch has this length (the longest "
                             "batches come late, after any profile window)")
    parser.add_argument("--late_from_step", type=int, default=0)
    parser.add_argument("--max_seq_length", type=int, default=None,
                        help="the longest batch the data can make (declared, as Hugging Face's scripts do)")
    parser.add_argument("--teacher", action="store_true",
                        help="targets are a fixed linear function of the inputs plus a little noise, so the "
                             "gradient has a signal beside its noise (the goodput tests' noise scale)")
    parser.add_argument("--slow_optimizer_ms", type=float, default=0.0, help="an optimizer whose step takes this "
                        "much longer (a costly step a larger accumulation count amortises)")
    parser.add_argument("--gas_log", default=None, help="each rank writes <this>.<rank>.json: the gas of each "
                        "optimizer step it ran and the learning rate it stepped with (a batch ramp changes them)")
    parser.add_argument("--peak_log", default=None, help="each rank writes <this>.<rank>.json: its peak resident "
                        "set so far (bytes) after each optimizer step")
    parser.add_argument("--peak_to", default=None, help="each rank appends its peak resident set (bytes) here at the end")
    parser.add_argument("--check_deepspeed_first", action="store_true",
                        help="ask importlib.util.find_spec('deepspeed') before importing it, as transformers and "
                             "accelerate do")
    parser.add_argument("--use_deepspeed", action="store_true",
                        help="train on DeepSpeed's own engine (imported by name, so the launcher needs --engine "
                             "deepspeed: the fault tests on DeepSpeed's path)")
    autotuner.add_config_arguments(parser)
    args = parser.parse_args()

    if args.echo_args_to and os.environ.get("RANK", "0") == "0":
        with open(args.echo_args_to, "a") as handle:
            handle.write("\x1f".join(sys.argv[1:]) + "\n")
    if args.echo_start_method_to and rank_zero():
        with open(args.echo_start_method_to, "a") as handle:
            handle.write(multiprocessing.get_start_method() + "\n")
    config = fill_auto(args.deepspeed_config or args.deepspeed, {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    })
    torch.manual_seed(0)
    if args.blocks:
        model = ChainBlocks(args.blocks, args.width)
    else:
        model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    slow = None
    if args.slow_optimizer_ms:
        params = config.pop("optimizer")["params"]

        class SlowAdamW(torch.optim.AdamW):
            def step(self, closure=None):
                time.sleep(args.slow_optimizer_ms / 1e3)
                return super().step(closure)

        slow = SlowAdamW(model.parameters(), lr=params["lr"])
    if args.use_deepspeed:
        if args.check_deepspeed_first:
            assert find_spec("deepspeed") is not None
        deepspeed = importlib.import_module("deepspeed")
        if slow is None:
            config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's fused Adam is GPU-only
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=slow,
                                          config=config)
    elif slow is not None:
        engine, *_ = autotuner.initialize(model=model, optimizer=slow, config=config)
    else:
        engine, *_ = autotuner.initialize(model=model, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    ms_per_step = {int(m): float(ms) for m, ms in (at.split(":") for at in args.ms_per_step_at)}.get(
        micro, args.ms_per_step)
    if args.loader_workers:
        side_loader = torch.utils.data.DataLoader(range(64), num_workers=args.loader_workers, persistent_workers=True)
        held_batches = iter(side_loader)
        next(held_batches)  # the workers are running from here on
    if args.child_process:
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],  # noqa: F841
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if args.fail_if_micro_batch_at_least and micro >= args.fail_if_micro_batch_at_least:
        raise ValueError(f"refusing micro-batch {micro}")
    if args.pid_dir:
        os.makedirs(args.pid_dir, exist_ok=True)
        with open(os.path.join(args.pid_dir, f"{os.getpid()}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    planned: dict[str, set[int]] = {}
    for item in args.fault_at_micro:
        at, kind = item.split(":")
        if kind not in ("fail", "kill", "exit", "hang"):
            parser.error(f"--fault_at_micro: unknown fault {kind!r}")
        planned.setdefault(kind, set()).add(int(at))

    def fires(kind: str) -> bool:
        return micro in planned.get(kind, ()) if planned else micro >= args.fault_min_micro

    hang = fires("hang") and args.hang_at_step
    if hang and args.hang_once_file:
        if os.path.exists(args.hang_once_file):
            hang = 0
        elif rank_zero():
            open(args.hang_once_file, "w").close()
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(engine.device)
    torch.manual_seed(1000 + engine.global_rank)  # each rank draws its own batches, as a sampler shards them
    per_sample_s = args.ms_per_sample / 1e3 * (4 if args.slow_above and micro > args.slow_above else 1)
    rank = engine.global_rank
    ran: list[list[float]] = []  # (gas, lr) per optimizer step
    peaks: list[int] = []
    for step in range(1, args.steps + 1):
        ran.append([engine.gradient_accumulation_steps(), engine.get_lr()[0]])
        if hang and step == args.hang_at_step:
            time.sleep(3600)
        if fires("exit") and step == args.exit_at_step:
            sys.exit(0)
        if fires("fail") and step == args.fail_at_step and rank == args.fail_rank:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if args.segfault_if_forked and step == 2 and rank == 1 and multiprocessing.parent_process() is not None:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fires("kill") and step == args.fail_at_step and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        length = args.seq_len
        if args.lengths:
            shortest, longest = (int(v) for v in args.lengths.split(":"))
            drawn = random.Random(step * 1000 + rank).randint(shortest, longest)
            length = args.late_length if args.late_length and step >= args.late_from_step else drawn
        for _ in range(engine.gradient_accumulation_steps()):
            held = None
            if args.mem_per_sample_mb and not args.lengths:
                # Resident (written); on a GPU this is where a real CUDA out-of-memory error comes from.
                held = torch.ones(int(micro * args.mem_per_sample_mb * 2**20 / 4), device=engine.device)
            shape = (micro, length, 16) if args.blocks or args.lengths else (micro, 16)
            x = torch.randn(*shape, device=engine.device)
            y = torch.randn(micro, length, 1, device=engine.device) if args.lengths and not args.blocks else \
                torch.randn(micro, 1, device=engine.device)
            if args.teacher and not (args.blocks or args.lengths):
                y = x @ teacher + 0.1 * y
            output = engine(x)
            if args.mem_per_sample_mb and args.lengths:  # held from the forward on, as activations are
                scale = length / args.seq_len
                held = torch.ones(int(micro * args.mem_per_sample_mb * scale * 2**20 / 4), device=engine.device)
            loss = nn.functional.mse_loss(output, y)
            engine.backward(loss)
            time.sleep(per_sample_s * micro + args.ms_per_micro_step / 1e3)
            del held
            engine.step()
        time.sleep(ms_per_step / 1e3)
        if args.peak_log:
            peaks.append(resident_peak_bytes())
    if args.gas_log:
        with open(f"{args.gas_log}.{rank}.json", "w") as handle:
            json.dump(ran, handle)
    if args.peak_log:
        with open(f"{args.peak_log}.{rank}.json", "w") as handle:
            json.dump(peaks, handle)
    if args.peak_to:
        with open(args.peak_to, "a") as handle:
            handle.write(f"{rank} {resident_peak_bytes()}\n")
    if rank == 0:
        print(f"done: {engine.global_steps} steps", flush=True)


def resident_peak_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


if __name__ == "__main__":
    main()
