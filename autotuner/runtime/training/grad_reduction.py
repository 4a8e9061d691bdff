"""How gradients are reduced across ranks: DeepSpeed's communication_data_type,
prescale_gradients and gradient_predivide_factor.

DeepSpeed (engine.allreduce_bucket) casts the bucket to communication_data_type, then either
divides by the world size before the all-reduce (prescale_gradients) or divides by
gradient_predivide_factor before it and by world/factor after it (the default, factor 1). Every
choice gives the mean; they differ in rounding and in the range fp16 must hold. Under DDP (our
stages 0 and 1) a communication hook does exactly that. Under FSDP2 (stages 2 and 3) the dtype is
MixedPrecisionPolicy.reduce_dtype, and FSDP2 splits the division itself (by about sqrt(world)
before and after, for fp16), so the two scaling keys get one warning there.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class GradientReduction:
    dtype: torch.dtype | None  # None: the gradients' own dtype
    prescale: bool
    predivide_factor: float
    scaling_set: bool  # prescale_gradients true or a gradient_predivide_factor other than 1: not DeepSpeed's default

    @classmethod
    def from_config(cls, config: Any) -> "GradientReduction | None":
        """None when the config asks for DeepSpeed's default reduction (none of the keys, or
        `prescale_gradients: false` and factor 1, as DeepSpeed-Chat writes them): torch's own, unchanged."""
        dtype = DTYPES[config.communication_data_type] if config.communication_data_type else None
        scaling_set = bool(config.prescale_gradients) or config.gradient_predivide_factor != 1.0
        if dtype is None and not scaling_set:
            return None
        return cls(dtype, config.prescale_gradients, config.gradient_predivide_factor, scaling_set)


# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
def ddp_reduction_hook(reduction: GradientReduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: DeepSpeed's allreduce_bucket on one DDP bucket."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    tensor = buffer.to(reduction.dtype) if reduction.dtype not in (None, buffer.dtype) else buffer
    if reduction.prescale:
        tensor.mul_(1.0 / world)
    elif reduction.predivide_factor != 1.0:
        tensor.mul_(1.0 / reduction.predivide_factor)

    def finish(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        if not reduction.prescale and reduction.predivide_factor != world:
            reduced.mul_(reduction.predivide_factor / world)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return dist.all_reduce(tensor, async_op=True).get_future().then(finish)
