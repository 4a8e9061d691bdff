"""A short timed probe of the collectives ZeRO uses, on the job's own process group.

Run by every rank of a profile launch so the tuner can cost each ZeRO stage's communication
from measured bandwidth (tuning/models/comm_fit.py fits latency + bytes / bandwidth per op): stage 0
and 1 all-reduce gradients, stage 2 reduce-scatters them, stage 3 also all-gathers parameters.

Cost, measured on 2 CPU ranks with gloo over loopback (the project's 2-core machine, torch
2.13, the default sizes 64 KiB..16 MiB, 5 repeats, 1 warm-up): 0.40-0.61 s per probe over 10
runs (median 0.51 s) with the cores nearly idle, 0.55-0.79 s over 12 runs while other tests kept
both cores busy (load average 3.2-3.5). Three quarters of it is the 16 MiB size (0.17 s without
it); CPU keeps that size all the same, under 1 s, since the bandwidth fit needs it most: the
small sizes are latency and noise.
gloo in torch 2.13 runs all three ops on CPU tensors, reduce_scatter included (checked with a
2-rank torchrun), so every op recorded was really run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from autotuner.core.probe_records import CollectiveTiming

FP32_BYTES = 4
SIZES_BYTES = (2**16, 2**20, 2**22, 2**24)

# torch 2.13 renamed the tensor forms and warns on the old names; older torch has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def probe_collectives(device: torch.device, group: Any = None, sizes_bytes: tuple[int, ...] = SIZES_BYTES,
                      repeats: int = 5, warmup: int = 1, ops: tuple[str, ...] = ("all_reduce", "reduce_scatter",
                                                                                 "all_gather"),
                      group_size: int = 0) -> tuple[CollectiveTiming, ...]:
    """Time all_reduce, reduce_scatter and all_gather of fp32 tensors of each size on `group`
    (None: the default group, which the engine's DDP, ZeRO-1 and FSDP2 all use).

    Every rank must call it. Sizes are the full, unsharded tensor in bytes, rounded down to a
    multiple of world_size * 4 so the tensor splits evenly into fp32 shards; on CUDA a size whose
    buffers would not fit in what the fullest rank has left is skipped. Each timing is the median
    over `repeats` of the slowest rank's time for one call, so every rank returns the same
    records. With one rank there is nothing to time: ()."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"probe_collectives: repeats must be >= 1 and warmup >= 0, not {repeats} and {warmup}")
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return ()
    numels = [size // (world_size * FP32_BYTES) * world_size for size in sizes_bytes]
    room = _free_bytes_on_every_rank(device, group)
    # A size's buffers are 1.5x its bytes; 2x leaves the backend room for its own.
    numels = [n for n in numels if n > 0 and (room is None or 2 * n * FP32_BYTES <= room)]
    timed, local = [], []
    for numel in numels:
        # One size's buffers at a time. Zeros, so repeated in-place sums stay finite.
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.zeros(numel // world_size, dtype=torch.float32, device=device)
        calls = {"all_reduce": lambda: dist.all_reduce(full, group=group),
                 "reduce_scatter": lambda: _reduce_scatter(shard, full, group=group),
                 "all_gather": lambda: _all_gather(full, shard, group=group)}
        for op, call in calls.items():
            if op not in ops:
                continue
            timed.append((op, numel * FP32_BYTES))
            local.append([time_once(call, device, group) for _ in range(warmup + repeats)][warmup:])
        del full, shard
    if not timed:
        return ()
    slowest = torch.tensor(local, dtype=torch.float64, device=device)
    # One collective for all timings: each repeat's slowest rank decides it, on every rank alike.
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return tuple(CollectiveTiming(op, nbytes, statistics.median(seconds), group_size)
                 for (op, nbytes), seconds in zip(timed, slowest.cpu().tolist()))


# Tensor parallelism's all-reduces carry a micro-batch's hidden states: small.
SUBGROUP_SIZES_BYTES = (2**12, 2**16, 2**20)


def tensor_parallel_groups() -> tuple[tuple[int, Any], ...]:
    """(k, this rank's group of k consecutive ranks) for each k > 1 that divides the world, the
    world itself included (as the default group, None): tensor parallelism's groups at degree k
    (its ranks are consecutive, as DeepSpeed lays them). Every rank must call it: every rank
    creates every group, in order."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    found = []
    for size in range(2, world + 1):
        if world % size:
            continue
        own = None  # the world: the default group
        for start in range(0, world, size) if size < world else ():
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                own = group
        found.append((size, own))
    return tuple(found)


def probe_subgroups(device: torch.device, sizes_bytes: tuple[int, ...] = SUBGROUP_SIZES_BYTES,
                    groups: tuple[tuple[int, Any], ...] | None = None) -> tuple[CollectiveTiming, ...]:
    """all_reduce timed on tensor parallelism's groups at each degree (`groups`, else
    tensor_parallel_groups()), every group at once, at these small sizes (which the whole group's
    probe leaves out). Every rank must call it; each returns its own group's."""
    found: list[CollectiveTiming] = []
    for size, own in groups if groups is not None else tensor_parallel_groups():
        # Two warm-up calls: a new group's first collective also sets up its connections.
        found += probe_collectives(device, own, sizes_bytes, warmup=2, ops=("all_reduce",), group_size=size)
    return tuple(found)


def _free_bytes_on_every_rank(device: torch.device, group: Any) -> int | None:
    """On CUDA, the least memory any rank could still allocate: the device's free memory plus
    what its caching allocator holds unused. A probe that ran out of memory would leave an OOM
    marker and condemn a configuration that trained. None on CPU, where no such cap is kept."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    unused_cache = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    room = torch.tensor([free + unused_cache], dtype=torch.int64, device=device)
    dist.all_reduce(room, op=dist.ReduceOp.MIN, group=group)
    return int(room.item())


def time_once(call: Callable[[], Any], device: torch.device, group: Any) -> float:
    """One call's wall time on this rank, started together with the others (a barrier)."""
    dist.barrier(group=group)
    return seconds_of(call, device)


def seconds_of(call: Callable[[], Any], device: torch.device) -> float:
    """One call's wall time on this rank, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
