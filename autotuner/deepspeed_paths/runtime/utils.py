"""`autotuner.runtime.utils`: the helpers scripts import from `deepspeed.runtime.utils`."""

from __future__ import annotations

import gc

import psutil
import torch.distributed as dist

from autotuner.runtime.accelerator import get_accelerator
from autotuner.runtime.pipeline.module import set_random_seed  # noqa: F401  (deepspeed.runtime.utils')


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print device and host memory on rank 0, when `force` (DeepSpeed's gate), then reset the peaks."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accelerator = get_accelerator()
    gib = 2**30
    print(message)
    print(f"MA {accelerator.memory_allocated() / gib:.2f} GB Max_MA {accelerator.max_memory_allocated() / gib:.2f} GB "
          f"CA {accelerator.memory_reserved() / gib:.2f} GB Max_CA {accelerator.max_memory_reserved() / gib:.2f} GB ")
    host = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(host.total - host.available) / gib:.2f} GB, percent = {host.percent}%")
    accelerator.reset_peak_memory_stats()
