"""Tensor parallelism on our engine: the (dp, tp) layout of the ranks, the model split by its plan
with torch's DTensor, and what TP changes in a step (the gradient norm, the batch check).

The layout is DeepSpeed's (`groups._init_tp_mesh_device`): the ranks of a TP group are
consecutive, `[k*tp, ..., k*tp + tp - 1]`, so a TP group stays inside a node, and a rank's
data-parallel rank is `rank // tp`. torch's `init_device_mesh` over `(dp, tp)` gives exactly
that. Splitting comes first, on the `tp` mesh (`parallelize_module` with the plan of
tp_plan.py); the ZeRO stage then works over the `dp` mesh, in torchtitan's order: FSDP2's
`fully_shard(mesh=mesh["dp"])` at stages 2-3 (it shards the split parameters again over dp); at
stage 0 no wrapper, the engine averaging the gradients over the dp group (DDP's device_mesh
path would swap the split parameters for unmarked local tensors between forwards, and every
state dict with them); stage 1 likewise, with ZeroRedundancyOptimizer over the dp group stepping
shadows of the local shards (split_zero.py: it broadcasts parameters, which DTensor cannot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.core.errors import UnsupportedError, UsageError
from autotuner.runtime.distributed import DistributedContext, warn_once


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: its tensor-parallel group and its data-parallel replica."""

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    mesh: Any = None  # torch's DeviceMesh over ("dp", "tp"); None without tensor parallelism

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def tp_group(self) -> Any:
        return self.mesh["tp"].get_group() if self.mesh is not None else None

    @property
    def dp_group(self) -> Any:
        """The data-parallel group; None means the default group (every rank is data parallel, no mesh)."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def tp_source_rank(self) -> int:
        """The global rank of this TP group's first rank (DeepSpeed's get_tensor_model_parallel_src_rank);
        read from the mesh, which inside a pipeline's stage does not start at rank 0."""
        if self.mesh is None:
            return self.dp_rank * self.tp_size
        return int(self.mesh["tp"].mesh.flatten()[0])


def data_parallel_layout(ctx: DistributedContext) -> ParallelLayout:
    return ParallelLayout(1, ctx.world_size, 0, ctx.rank)


# The layout whose groups DeepSpeed's `utils.groups` functions answer with, beside the default
# process group it was built in (a layout from an ended group is no layout). Set by initialize
# under tensor parallelism, or by groups._init_tp_mesh_device before it, as DeepSpeed's groups
# module keeps its TP and DP groups in module globals.
_current: tuple[ParallelLayout, Any] | None = None


def current_layout() -> ParallelLayout | None:
    """The registered (dp, tp) layout; None before one is built in this process group."""
    if _current is None or not dist.is_initialized():
        return None
    layout, world = _current
    return layout if world is dist.group.WORLD else None


def register_layout(layout: ParallelLayout) -> None:
    global _current
    _current = (layout, dist.group.WORLD)


def parallel_layout(ctx: DistributedContext, tp_size: int) -> ParallelLayout:
    """The (dp, tp) layout for `tp_size` (collective where it builds the mesh: every rank calls it).
    A layout already built for the same size (by groups._init_tp_mesh_device, or an earlier
    initialize) is reused, so the script's groups and the engine's are the same groups."""
    if tp_size <= 1:
        return data_parallel_layout(ctx)
    existing = current_layout()
    if existing is not None:
        if existing.tp_size != tp_size:
            raise UsageError(f"tensor_parallel.autotp_size {tp_size}: the tensor-parallel groups of this process "
                             f"group were already built for {existing.tp_size} ranks (by deepspeed.utils.groups."
                             "_init_tp_mesh_device or an earlier initialize); give the same size")
        return existing
    return mesh_layout(ctx, tp_size)


def mesh_layout(ctx: DistributedContext, tp_size: int, dp_size: int | None = None,
                what: str = "tensor_parallel.autotp_size") -> ParallelLayout:
    """A new (dp, tp) mesh over the world, consecutive ranks in a TP group; tp_size 1 included (a
    group of one per rank, as DeepSpeed's groups build it). Collective."""
    if ctx.world_size % tp_size:
        raise UsageError(f"{what} {tp_size}: must divide the number of ranks ({ctx.world_size})")
    if tp_size > ctx.local_world_size or ctx.local_world_size % tp_size:
        raise UsageError(f"{what} {tp_size}: a tensor-parallel group must lie inside one node, so "
                         f"it must divide the ranks per node ({ctx.local_world_size})")
    dp = ctx.world_size // tp_size
    if dp_size is not None and dp_size != dp:
        raise UsageError(f"{what} {tp_size} with data_parallel_size {dp_size}: the two must multiply to the "
                         f"number of ranks ({ctx.world_size})")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (dp, tp_size), mesh_dim_names=("dp", "tp"))
    return ParallelLayout(tp_size, dp, ctx.rank % tp_size, ctx.rank // tp_size, mesh)


@dataclass(frozen=True)
class SplitModel:
    """What splitting did: the plan's words for the log, and the parameters it split (by name from
    the model's root), which the gradient norm counts on every TP rank."""

    source: str
    split_parameters: frozenset[str]


def split_model(model: nn.Module, layout: ParallelLayout, source: tuple[int, Any] = (0, None)) -> SplitModel:
    """Split `model` in place over the layout's `tp` mesh. Every rank first takes the weights of
    `source` (global rank, group: rank 0 of the world, as DeepSpeed's engine broadcasts them; a
    pipeline stage's first rank over the stage's ranks), and its TP group's first rank's random
    state, so that dropout on the activations a TP group shares draws the same mask on each rank."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from autotuner.runtime.training.tp_plan import divide_head_attributes, dtensor_styles, tp_plan

    plan = tp_plan(model, layout.tp_size)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=source[0], group=source[1])
    _share_random_state(layout)
    parallelize_module(model, layout.mesh["tp"], dtensor_styles(plan))
    divide_head_attributes(model, plan, layout.tp_size)
    split = frozenset(name for name, param in model.named_parameters()
                      if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements))
    warn_once(f"tensor_parallel: {len(plan.split)} Linear layers split over {layout.tp_size} ranks by {plan.source}; "
              f"data-parallel size {layout.dp_size}")
    return SplitModel(plan.source, split)


def _share_random_state(layout: ParallelLayout) -> None:
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=layout.tp_source_rank, group=layout.tp_group)
    torch.set_rng_state(state[0])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_state = [torch.cuda.get_rng_state()]
        dist.broadcast_object_list(cuda_state, src=layout.tp_source_rank, group=layout.tp_group)
        torch.cuda.set_rng_state(cuda_state[0])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tp_gradient_norm(named_parameters: Iterable[tuple[str, nn.Parameter]], split: SplitModel, layout: ParallelLayout,
                     sharded_over_dp: bool, max_norm: float) -> torch.Tensor | None:
    """The gradients' global 2-norm, DeepSpeed's way under AutoTP (runtime/utils.py clip_grad_norm_):
    each split parameter's local gradient counts on every TP rank, a whole one on TP rank 0 only,
    summed over the TP group, and over the dp group too where FSDP2 shards them there. Clipped to
    `max_norm` when it is above 0 (the same coefficient on every rank). torch's clip_grad_norm_
    cannot mix the split parameters' 2-D meshes with the others' 1-D ones."""
    named = [(name, param) for name, param in named_parameters if param.grad is not None]
    if not named:
        return None
    device = _local(named[0][1].grad).device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for name, param in named:
        if name in split.split_parameters or layout.tp_rank == 0:
            squares += _local(param.grad).detach().float().pow(2).sum()
    dist.all_reduce(squares, group=None if sharded_over_dp else layout.tp_group)
    norm = squares.sqrt()
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, param in named:
            _local(param.grad).mul_(coefficient.to(_local(param.grad).dtype))
    return norm


def check_same_batch(layout: ParallelLayout, inputs: tuple, kwargs: dict) -> None:
    """Every rank of a TP group must see the same batch (they compute one replica's step together).
    Compared once, at the first forward, as DeepSpeed's engine does (a one-shot forward pre-hook)."""
    from torch.utils._pytree import tree_leaves

    # Inside dicts, lists and tuples too: a script may pass its batch as one dict.
    tensors = [value for value in tree_leaves((inputs, kwargs)) if isinstance(value, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    summary = torch.tensor([float(sum(t.numel() for t in tensors)),
                            float(sum(t.detach().double().sum().item() for t in tensors if t.numel()))],
                           dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(summary) for _ in range(layout.tp_size)]
    dist.all_gather(gathered, summary, group=layout.tp_group)
    if any(not torch.equal(other, gathered[0]) for other in gathered):
        raise UsageError(f"tensor_parallel: the {layout.tp_size} ranks of a tensor-parallel group got different batches "
                         "at the first forward; they must see the same one: take the engine's loader "
                         "(initialize(training_data=...)), or shard your sampler by "
                         "engine.get_data_parallel_rank() of engine.get_data_parallel_world_size()")


def refuse_on_device(keep_module_on_host: bool, device: torch.device) -> None:
    if keep_module_on_host and device.type == "cuda":
        raise UnsupportedError("tensor_parallel.keep_module_on_host: keeping the shards in host memory is not carried "
                               "on CUDA; remove it, or train on DeepSpeed's engine")
