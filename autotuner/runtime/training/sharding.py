"""ZeRO stages on native PyTorch: DDP (0), DDP + ZeroRedundancyOptimizer (1), FSDP2 (2, 3).

No sharding is written here; this module only chooses and configures torch's wrappers.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from autotuner.config.models import ZeroConfig
from autotuner.core.errors import UnsupportedError
from autotuner.runtime.distributed import DistributedContext, warn_once
from autotuner.runtime.measure.gradient_noise import GradientNoiseProbe, gradient_noise_hook
from autotuner.runtime.training.grad_reduction import GradientReduction, ddp_reduction_hook

_LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ddp_bucket_cap_mb(zero: ZeroConfig) -> float | None:
    """DeepSpeed's reduce_bucket_size counts elements; DDP's bucket_cap_mb counts MiB of fp32 gradients."""
    if zero.reduce_bucket_size is None:
        return None
    return zero.reduce_bucket_size * 4 / 2**20


def _offloaded(zero: ZeroConfig) -> list[str]:
    return [name for name in ("offload_optimizer", "offload_param")
            if getattr(zero, name) is not None and getattr(zero, name).device != "none"]


def settle_offload(zero: ZeroConfig, stage: int, device: torch.device) -> ZeroConfig:
    """CPU offload as this device allows it. On a CPU-only machine everything already lives in host
    memory, so the sections are dropped with a warning (DeepSpeed trains such configs). On CUDA
    offload is FSDP2's CPUOffloadPolicy, which exists only at stages 2 and 3."""
    offload = _offloaded(zero)
    if not offload:
        return zero
    if device.type != "cuda":
        warn_once(f"zero_optimization.{offload[0]}.device \"cpu\": this machine has no GPU, so parameters and "
                  "optimizer state already live in host memory; training without offload")
        return zero.model_copy(update={"offload_optimizer": None, "offload_param": None})
    if stage < 2:
        raise UnsupportedError(
            f"zero_optimization.{offload[0]}: CPU offload needs ZeRO stage 2 or 3 here (torch's FSDP2 "
            f"CPUOffloadPolicy; stage {stage} keeps optimizer state on the GPU); use stage 2, which also "
            "partitions gradients, with the same offload section"
        )
    return zero


def check_supported(stage: int, zero: ZeroConfig, precision: str, device: torch.device) -> None:
    """Refuse, before any wrapping, what cannot work on this device or stage."""
    if _offloaded(zero) and (device.type != "cuda" or stage < 2):
        raise UnsupportedError("zero_optimization: offload must be settled with settle_offload() first")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UnsupportedError("bf16.enabled: this GPU does not support bf16; use fp16 or fp32")


def shard_units(model: nn.Module, persistence_threshold: int) -> list[nn.Module]:
    """Modules sharded on their own: the entries of every ModuleList (transformer blocks).

    Blocks smaller than `stage3_param_persistence_threshold` elements stay with their parent.
    """
    units = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if sum(p.numel() for p in block.parameters()) >= persistence_threshold:
                    units.append(block)
    return units


def _fsdp2(model: nn.Module, stage: int, zero: ZeroConfig, precision: str, ctx: DistributedContext,
           reduction: GradientReduction | None, dp_mesh: Any = None) -> nn.Module:
    """FSDP2 over every rank, or over `dp_mesh` (the data-parallel side of a tensor-parallel layout,
    whose split parameters FSDP2 then shards a second time)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = dp_mesh if dp_mesh is not None else init_device_mesh(ctx.device.type, (ctx.world_size,))
    mixed = MixedPrecisionPolicy()
    if precision in _LOW_PRECISION:
        # Gradients are reduced in fp32 so ranks agree to the last bit with DeepSpeed's default.
        mixed = MixedPrecisionPolicy(param_dtype=_LOW_PRECISION[precision], reduce_dtype=torch.float32)
    if reduction is not None and reduction.dtype is not None:
        mixed = MixedPrecisionPolicy(param_dtype=mixed.param_dtype, reduce_dtype=reduction.dtype)
    if reduction is not None and reduction.scaling_set:
        warn_once(f"prescale_gradients / gradient_predivide_factor: at ZeRO stage {stage} torch's FSDP2 reduces "
                  "the gradients and chooses where to divide by the world size itself (about sqrt(world) before "
                  "and after, in fp16); the gradients are the same mean. The keys act exactly at stages 0 and 1")
    offloading = any(
        s is not None and s.device == "cpu" for s in (zero.offload_optimizer, zero.offload_param)
    )
    offload = CPUOffloadPolicy(pin_memory=bool(zero.offload_param and zero.offload_param.pin_memory)) if offloading else OffloadPolicy()
    if ctx.world_size > 1 and dp_mesh is None:  # a split model took rank 0's weights before it was split
        # Every rank starts from rank 0's weights, as DDP and DeepSpeed's engine (and its zero.Init)
        # make them: FSDP2 keeps each rank's own slice of whatever that rank built.
        broadcast_from_rank_zero(model)
    reshard = stage == 3
    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed, offload_policy=offload)
    units = shard_units(model, zero.stage3_param_persistence_threshold or 0)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if zero.overlap_comm and len(units) > 1:
        # Explicit one-ahead prefetch: gather block i+1 while block i computes.
        for current, following in zip(units, units[1:]):
            current.set_modules_to_forward_prefetch([following])
        for current, previous in zip(units[1:], units):
            current.set_modules_to_backward_prefetch([previous])
    return model


def broadcast_from_rank_zero(model: nn.Module) -> None:
    """Every rank's parameters and buffers set to rank 0's (collective)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def wrap_model(model: nn.Module, stage: int, zero: ZeroConfig, precision: str, ctx: DistributedContext,
               reduction: GradientReduction | None = None, noise: GradientNoiseProbe | None = None,
               dp_mesh: Any = None, forward_only: bool = False) -> nn.Module:
    """Move `model` to the device and wrap it for `stage`. FSDP2 shards it in place. A model split
    by tensor parallelism comes with its `dp_mesh`: FSDP2 shards over it at stages 2-3; at stage 0
    it stays unwrapped, its split parameters whole DTensors, and the engine averages the gradients
    over the dp group at each boundary (DeepSpeed's stage 0 does its own all-reduce too), so that
    every state dict still knows which tensors are split. `forward_only`: an engine without an
    optimizer (DeepSpeed-Chat's reference and reward models), which never reduces a gradient: at
    stages 0-1 no DDP, only rank 0's weights on every rank, as DeepSpeed's engine broadcasts them."""
    check_supported(stage, zero, precision, ctx.device)
    model = model.to(ctx.device)
    if stage >= 2:
        return _fsdp2(model, stage, zero, precision, ctx, reduction, dp_mesh)
    if dp_mesh is not None:
        return model
    if forward_only:
        if ctx.world_size > 1:
            broadcast_from_rank_zero(model)
        return model
    return wrap_ddp(model, zero, ctx, reduction=reduction, noise=noise)


def wrap_ddp(model: nn.Module, zero: ZeroConfig, ctx: DistributedContext,
             find_unused_parameters: bool = False, knobs: dict[str, Any] | None = None,
             reduction: GradientReduction | None = None,
             noise: GradientNoiseProbe | None = None) -> DistributedDataParallel:
    """DDP with the ZeRO knobs that map onto it; `knobs` (bucket_cap_mb, gradient_as_bucket_view,
    from online tuning) take precedence. Collective: every rank must call it together."""
    kwargs: dict[str, Any] = {}
    cap = ddp_bucket_cap_mb(zero)
    if cap is not None:
        kwargs["bucket_cap_mb"] = cap
    if zero.contiguous_gradients is not None:
        kwargs["gradient_as_bucket_view"] = zero.contiguous_gradients
    for name in ("bucket_cap_mb", "gradient_as_bucket_view"):
        if knobs and name in knobs:
            kwargs[name] = knobs[name]
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters,
                                  **kwargs)
    if noise is not None:  # reads the gradient noise around the same reduction (DDP takes one hook)
        noise.reduction = reduction
        ddp.register_comm_hook(noise, gradient_noise_hook)
    elif reduction is not None:
        ddp.register_comm_hook(reduction, ddp_reduction_hook)
    return ddp


_BUCKET_ELEMENTS = 2**23  # 32 MiB of fp32 gradients a bucket, about DDP's 25 MiB


def average_gradients(parameters: list[nn.Parameter], world_size: int, group: Any = None,
                      reduction: GradientReduction | None = None) -> None:
    """Average gradients over the ranks ourselves, for a step whose backward DDP did not reduce (or
    reduced only in part). A parameter with a gradient on some rank gets zeros elsewhere, as
    DDP's find_unused_parameters does; one with a gradient nowhere keeps None, so the optimizer
    skips it. Averaging what DDP already averaged leaves it as it is: every rank holds the same.
    `reduction` is DeepSpeed's dtype and division for the all-reduce, as DDP's hook applies them."""
    import torch.distributed as dist

    if not parameters:
        return
    device = parameters[0].device
    has_grad = torch.tensor([float(p.grad is not None) for p in parameters], device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    grads: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for param, anywhere in zip(parameters, has_grad.tolist()):
        if not anywhere:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        local = param.grad.to_local() if is_dtensor(param.grad) else param.grad  # a split parameter's shard
        buckets = grads.setdefault(local.dtype, [[]])
        if buckets[-1] and sum(g.numel() for g in buckets[-1]) + local.numel() > _BUCKET_ELEMENTS:
            buckets.append([])
        buckets[-1].append(local)
    for bucket in (bucket for buckets in grads.values() for bucket in buckets):  # one all-reduce a bucket, as DDP
        flat = torch._utils._flatten_dense_tensors(bucket)
        if reduction is not None and reduction.dtype is not None:
            flat = flat.to(reduction.dtype)
        before = world_size if reduction is not None and reduction.prescale else \
            (reduction.predivide_factor if reduction is not None else 1.0)
        if before != 1.0:
            flat.mul_(1.0 / before)
        dist.all_reduce(flat, group=group)
        if before != world_size:
            flat.mul_(before / world_size)
        for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def zero_redundancy(
    param_groups: Iterable[dict[str, Any]], optimizer_cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
    process_group: Any = None,
) -> torch.optim.Optimizer:
    """ZeRO-1: optimizer state sharded across ranks by torch's ZeroRedundancyOptimizer (over the
    data-parallel `process_group` under tensor parallelism, else every rank)."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    # A client optimizer's `defaults` may hold entries its constructor does not take (torch's AdamW
    # records decoupled_weight_decay=True); only constructor arguments are passed on.
    accepted = set(inspect.signature(optimizer_cls.__init__).parameters)
    kwargs = {key: value for key, value in defaults.items() if key in accepted}
    return ZeroRedundancyOptimizer(list(param_groups), optimizer_class=optimizer_cls, process_group=process_group,
                                   **kwargs)


def gradient_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """The 2-norm of all gradients (clipped to `max_norm` when it is > 0), as a tensor. Under FSDP2
    the local shards' norms are combined across ranks (a collective every rank calls)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def finite_norm(norm: torch.Tensor | None) -> bool:
    """Whether a gradient norm from gradient_norm is finite (no gradient at all counts as finite)."""
    if norm is None:
        return True
    return bool(torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor: an FSDP2 parameter's shard (or its state-dict entry)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(value, DTensor)
