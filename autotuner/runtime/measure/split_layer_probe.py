"""What a tensor-parallel Linear costs beyond the same Linear unsplit, timed on each degree's groups
in a profile launch at degree 1 (issue 80, part 1).

Degree 1's launches time the model's matmuls, not what splitting them adds: at degree k each
split Linear runs through DTensor (its input wrapped, the op's sharding looked up and
dispatched, its output unwrapped, forward and backward) and one all-reduce over its k ranks (a
column layer's input gradient in the backward, a row layer's output in the forward). On a CPU
that dispatch is most of a split micro-step (35-50 ms against 3-4 ms of compute on the test
model's 12 split layers), so a prediction from degree 1 alone came out 61-80% short.

So the probe runs one small column-wise and one small row-wise Linear, split as the engine
splits them (torch's ColwiseParallel and RowwiseParallel through `parallelize_module`, on a
DeviceMesh over the degree's group), forward and backward and an optimizer step, and the same
layers unsplit at their local shapes, every group at once: back to back, as training runs them
(the prediction's figure), and each call started together with a barrier, the fastest repeat
(the floor, which the bound takes). The difference is what a split layer
adds at a small size: its dispatch, its all-reduce's latency, and its parameters' optimizer step
on DTensors (AdamW's; another optimizer's ops dispatch alike). The model
(tuning/models/degree_time.py) counts it once per split layer a micro-step (and a step) runs,
and the all-reduces' bytes past that small size from the collective probe's line.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.core.probe_records import SplitLayerTiming
from autotuner.runtime.measure.comm_probe import seconds_of, time_once

TOKENS = 4  # a small micro-batch's hidden states: what the all-reduce carries is latency, not bytes


def probe_split_layers(device: torch.device, groups: tuple[tuple[int, Any], ...], repeats: int = 9,
                       warmup: int = 3) -> tuple[SplitLayerTiming, ...]:
    """For each (degree, this rank's group) of `groups` (comm_probe.tensor_parallel_groups), a
    column-wise and a row-wise Linear timed split and unsplit. Every rank must call it; each
    returns its own group's timings (the slowest of the group's ranks at each repeat)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    width = 16 * dist.get_world_size()  # divides by every degree
    found = []
    for degree, group in groups:
        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
        for style, plan in (("colwise", ColwiseParallel()), ("rowwise", RowwiseParallel())):
            local_in, local_out = (width, width // degree) if style == "colwise" else (width // degree, width)
            split = parallelize_module(nn.Linear(width, width, device=device), mesh, plan)
            plain = nn.Linear(local_in, local_out, device=device)
            times = []
            for layer in (split, plain):
                x = torch.randn(1, TOKENS, local_in, device=device, requires_grad=True)
                # AdamW as the stand-in for the script's optimizer: on DTensor parameters its step
                # dispatches each op through DTensor too.
                optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)

                def forward_backward(layer=layer, x=x):
                    layer(x).sum().backward()
                    x.grad = None

                # The floor: each call started together (a barrier before it), the fastest repeat.
                floor = [time_once(forward_backward, device, group) for _ in range(warmup + repeats)][warmup:]
                layer.zero_grad(set_to_none=True)
                # The steady state: back to back after one barrier, as a training step runs them.
                # With more ranks than cores the two differ: a barrier before each call lets one
                # group's ranks take the cores while the others wait, a lull training never has.
                steady, step = [], []
                dist.barrier(group=group)
                for _ in range(warmup + repeats):
                    steady.append(seconds_of(forward_backward, device))
                    step.append(seconds_of(optimizer.step, device))
                    optimizer.zero_grad(set_to_none=True)
                times += [floor, steady[warmup:], step[warmup:]]
            slowest = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            rows = slowest.cpu().tolist()
            split_floor, plain_floor = min(rows[0]), min(rows[3])
            split_s, split_step_s, plain_s, plain_step_s = (statistics.median(rows[i]) for i in (1, 2, 4, 5))
            found.append(SplitLayerTiming(style, degree, split_s, plain_s, TOKENS * width * 4, split_step_s,
                                          plain_step_s, split_floor, plain_floor))
    return tuple(found)
