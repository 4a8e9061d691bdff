"""Apply communication knobs to a wrapped model between optimizer steps, and read back what is
really in effect (from the wrapper, not from what was asked: Bagua's tuned flag was never applied).

Called only at an accumulation boundary, after zero_grad: no gradient is in flight."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded on their own (not the root), in forward order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]


def rewrap_ddp(old: DistributedDataParallel, wrap) -> DistributedDataParallel:
    """A new DDP around the same module (same parameters, so the optimizer and its state are
    untouched). The old reducer's hooks are removed first, so gradients are reduced once."""
    if any(p.grad is not None for p in old.parameters()):
        raise RuntimeError("DDP knobs may change only between steps, with gradients cleared")
    remove = getattr(old, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()
    return wrap(old.module)


def apply_fsdp_prefetch(model: nn.Module, forward_depth: int, backward_depth: int) -> None:
    """Forward: each block all-gathers the next `forward_depth` blocks explicitly (0: none).
    Backward: depth 1 is FSDP2's implicit one-ahead default; 2 prefetches two blocks back."""
    units = fsdp_units(model)
    for index, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[index + 1:index + 1 + forward_depth])
        previous = units[max(0, index - backward_depth):index][::-1] if backward_depth > 1 else []
        unit.set_modules_to_backward_prefetch(previous)


def fsdp_prefetch_depths(model: nn.Module) -> tuple[int, int]:
    """(forward, backward) depth as FSDP2's state holds it, read from the first/last blocks."""
    units = fsdp_units(model)
    if not units:
        return 0, 1
    forward = len(units[0]._get_fsdp_state()._states_to_forward_prefetch)
    backward = len(units[-1]._get_fsdp_state()._states_to_backward_prefetch)
    return forward, max(1, backward)


def read_applied(model: nn.Module, reshard_after_backward: bool) -> dict[str, Any]:
    """Every knob's value as the wrapper holds it now."""
    if isinstance(model, DistributedDataParallel):
        cap = model.bucket_bytes_cap / 2**20
        return {"bucket_cap_mb": int(cap) if float(cap).is_integer() else cap,
                "gradient_as_bucket_view": bool(model.gradient_as_bucket_view)}
    forward, backward = fsdp_prefetch_depths(model)
    return {"forward_prefetch": forward, "backward_prefetch": backward,
            "reshard_after_backward": reshard_after_backward}
