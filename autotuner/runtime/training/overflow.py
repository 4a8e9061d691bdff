"""DeepSpeed's overflow record on `engine.optimizer`, which fp16 scripts read after each step.

DeepSpeed's fp16, bf16 and ZeRO optimizers keep `overflow` (whether the last step found an inf or
NaN among the gradients and was skipped); DeepSpeed-Chat's PPO trainer reads it after every step
(`get_overflow`), and with `--align_overflow` calls `optimizer.check_overflow(external=True)`
before stepping and sets `optimizer.skip_step = True` on the engine that did not overflow, so both
engines skip together. Here the same three names sit on whatever optimizer the engine steps, at
every stage and precision:

- `overflow`: False until a step; then whether that step was skipped for a non-finite gradient
  (fp16's loss scaler saw an overflow, or the ZeRO stage skips non-finite steps: loss_scale.py).
- `check_overflow(partition_gradients=True, external=False)`: whether the gradients accumulated
  so far hold an inf or NaN on any rank (collective); it sets `overflow` and returns it, and never
  changes the loss scale (`external`, DeepSpeed-Chat's flag for a check outside the step, is
  accepted for that reason).
- `skip_step`: set True, the next optimizer step drops its gradients without stepping and without
  touching the loss scale, and counts as skipped; it is False again afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def attach_overflow_record(optimizer: torch.optim.Optimizer, engine: Any) -> None:
    optimizer.overflow = False
    optimizer.skip_step = False

    def check_overflow(partition_gradients: bool = True, external: bool = False) -> bool:
        optimizer.overflow = gradients_overflow(engine)
        return optimizer.overflow

    optimizer.check_overflow = check_overflow


def gradients_overflow(engine: Any) -> bool:
    """Whether any rank's gradients (its shards under FSDP2) hold an inf or NaN."""
    found = torch.zeros((), device=engine.ctx.device)
    for param in engine.wrapped.parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not torch.isfinite(local).all():
            found.fill_(1.0)
            break
    if dist.is_initialized() and engine.ctx.world_size > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())
