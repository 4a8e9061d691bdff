"""`python -m autotuner.app.host_spec [--out cpu.json]`: a hardware spec of this machine's
CPU, measured, for `launcher --autotuning plan --hardware` (config/hardware.py; issue 80, part 3).

An accelerator is a core. Each figure is the best of a few timed runs at one thread, as a rank
runs when there is a core per rank:

- peak_fp32_flops, peak_bf16_flops: the fastest square matmul rate over sizes 256-1024;
- memory_bandwidth: a 64 MiB tensor copied (bytes read and written over the time);
- op_overhead_s: one small elementwise operator recorded by autograd, forward and backward, per
  operator (dispatch and autograd's bookkeeping, what an eager step pays per operator);
- intra_node: two gloo ranks on this machine, as `collectives`: the all-reduce and broadcast
  (what DDP and ZeRO 1 call) bare, at 4 bytes (latency a hop) and 16 MiB (bus bandwidth); the
  all-gather and reduce-scatter as FSDP2 runs them, unit by unit (their copies and hooks in
  them: on gloo they cost twice the bare collectives); the all-reduce's also as the link's own;
  inter_node is the same (one node);
- process_overhead_bytes: the resident set a rank adds past importing torch and the engine (which
  a script imports before its model, and the plan's census counts): the gloo group and a DDP
  step on a tiny model;
- memory_bytes: the machine's memory; overlap_communication false (gloo's threads share the
  cores the compute runs on).
Nothing here is fitted to a training run. Measured apart on an idle machine, these are faster
than a rank gets while its neighbours train beside it on the same cores; the plan's
compute_efficiency (1 unless the spec states it, or `calibrate` fits it on one measured layout)
is the share of them a rank keeps."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

REPEATS = 5
COPY_BYTES = 64 * 2**20
ALL_REDUCE_BYTES = 16 * 2**20
TOKENS = 128  # a micro-batch of 4 x 32: compute enough to contend with gloo, little enough to be quick


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # warm: the first call allocates and loads kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(dtype: torch.dtype) -> float:
    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        reps = max(1, 2**27 // n**3 * 4)
        seconds = _best(lambda: [torch.mm(a, b) for _ in range(reps)])
        best = max(best, 2 * n**3 * reps / seconds)
    return best


def copy_bandwidth() -> float:
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _best(lambda: dst.copy_(src))


def op_overhead() -> float:
    chain = 200
    x = torch.ones(4, requires_grad=True)

    def run():
        y = x
        for _ in range(chain):
            y = y * 1.0
        y.sum().backward()

    return _best(run) / (2 * chain)  # a forward operator and its backward each


def _resident() -> int:
    return psutil.Process().memory_info().rss


def _collectives(dist, repeats: int) -> dict:
    """Each collective's latency a hop (4 bytes) and bus bandwidth (16 MiB), inverted from the
    formulas tuning/models/spec_collectives.py costs them by, for a group of 2: one hop for a
    gather, scatter and broadcast, two for an all-reduce's ring; S/2 bytes a rank moves for a
    gather and scatter, S for an all-reduce and a broadcast."""
    figures = {}
    for op, hops, moved in (("all_reduce", 2, 1.0), ("all_gather", 1, 0.5), ("reduce_scatter", 1, 0.5),
                            ("broadcast", 1, 1.0)):
        def run(numel: int):
            if op == "all_reduce":
                x = torch.ones(numel)
                return lambda: dist.all_reduce(x)
            if op == "broadcast":
                x = torch.ones(numel)
                return lambda: dist.broadcast(x, 0)
            whole, part = torch.ones(2 * numel), torch.ones(numel)
            if op == "all_gather":
                return lambda: dist.all_gather_into_tensor(whole, part)
            return lambda: dist.reduce_scatter_tensor(part, whole)

        small, large = run(1), run(ALL_REDUCE_BYTES // 4 // (2 if op in ("all_gather", "reduce_scatter") else 1))
        dist.barrier()
        tiny = _best(lambda: [small() for _ in range(20)], repeats) / 20
        dist.barrier()
        big = _best(large, 3)
        latency = tiny / hops
        figures[op] = {"bus_bandwidth": moved * ALL_REDUCE_BYTES / max(big - hops * latency, 1e-9),
                       "latency": latency}
    return figures


def _fsdp_collectives(dist) -> dict:
    """The all-gather and reduce-scatter as FSDP2 runs them in training, unit by unit: forward and
    backward over units of two sizes (one ahead prefetched, as the engine does), less the same
    layers unsharded; without gradient sync (an accumulation micro-step: a gather a unit for the
    forward, another for the backward, with their autograd hooks), then with it (the
    reduce-scatter too). Each collective's latency is its cost a unit at the small size, its bus
    bandwidth the slope (S/2 bytes moved a rank for S of parameters): the copies in and out and
    the hooks included, which the library's bare collective does not pay."""
    from torch.distributed.fsdp import fully_shard

    units, costs = 4, {}
    block = lambda width: torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)  # noqa: E731
    for width in (32, 256):
        sharded = torch.nn.Sequential(*[block(width) for _ in range(units)])
        plain = torch.nn.Sequential(*[block(width) for _ in range(units)])
        for layer in sharded:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(sharded)  # (a root of its own: FSDP2 keeps the root's parameters gathered past the forward)
        for current, following in zip(sharded, list(sharded)[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
        x = torch.ones(4, TOKENS // 4, width)

        def step(model, sync: bool) -> None:
            if model is sharded:
                sharded.set_requires_gradient_sync(sync)
            model(x).sum().backward()

        def each(model, sync: bool) -> float:  # four calls a timing: one call is milliseconds, noise-sized
            dist.barrier()
            return _best(lambda: [step(model, sync) for _ in range(4)], 3) / 4

        alone = each(plain, False)
        accumulating = each(sharded, False)
        synced = each(sharded, True)
        size = 4 * sum(p.numel() for p in plain[0].parameters())
        costs[width] = (size, (accumulating - alone) / units / 2, (synced - accumulating) / units)
    (small, gather_small, scatter_small), (large, gather_large, scatter_large) = costs[32], costs[256]
    figures = {}
    for op, low, high in (("all_gather", gather_small, gather_large), ("reduce_scatter", scatter_small,
                                                                       scatter_large)):
        latency = max(low, 1e-7)
        figures[op] = {"bus_bandwidth": 0.5 * (large - small) / max(high - low, 1e-9), "latency": latency}
    return figures


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # A script imports the engine before it builds its model (the plan's census counts that in
    # the script's resident set); what a rank holds past it is the process group and DDP's state.
    import autotuner.runtime.initialize  # noqa: F401

    before = _resident()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    model(torch.ones(2, 8)).sum().backward()
    overhead = _resident() - before
    # FSDP2's figures are differences of timings on shared cores: the median of three
    runs = [_fsdp_collectives(dist) for _ in range(3)]
    fsdp = {op: {key: statistics.median(run[op][key] for run in runs) for key in runs[0][op]} for op in runs[0]}
    figures = {**_collectives(dist, 7), **fsdp}
    if rank == 0:
        Path(out).write_text(json.dumps({"collectives": figures, "process_overhead_bytes": max(0, overhead)}))
    dist.destroy_process_group()


def gloo_link() -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "link.json")
        mp.start_processes(_rank, args=(port, out), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def measure() -> dict:
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    link = gloo_link()
    reduce = link["collectives"]["all_reduce"]
    gloo = {"bandwidth": reduce["bus_bandwidth"], "latency": reduce["latency"], "collectives": link["collectives"]}
    return {"name": f"{cpu_name()} ({cores} cores)", "device": "cpu",
            "peak_bf16_flops": matmul_peak(torch.bfloat16), "peak_fp32_flops": matmul_peak(torch.float32),
            "memory_bytes": psutil.virtual_memory().total, "memory_bandwidth": copy_bandwidth(),
            "accelerators_per_node": cores, "intra_node": gloo, "inter_node": dict(gloo),
            "op_overhead_s": op_overhead(), "process_overhead_bytes": link["process_overhead_bytes"],
            "overlap_communication": False}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autotuner.app.host_spec", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--out", help="write the spec here (default: print it)")
    args = parser.parse_args(argv)
    text = json.dumps(measure(), indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"host spec written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
