"""What a workload's signature says about its model and device (tuning/models/transfer.py): the model's
family, a hash of its module types and block structure with every size left out (a GPT-2 of 4
blocks and one of 12, or of width 256 and 1024, are one family), and the device's name."""

from __future__ import annotations

import functools
import hashlib

import torch
from torch import nn

# Wrappers our engine, DeepSpeed or torch put around the user's modules: never part of a family.
_WRAPPER_PREFIXES = ("torch.distributed.", "torch.nn.parallel.", "torch._dynamo.", "deepspeed.")


def _user_class(module: nn.Module) -> type | None:
    """The class the user wrote: FSDP2's fully_shard subclasses it as FSDP<Name>, so that is
    walked back; wrappers (DDP, checkpoint and compile wrappers) give None."""
    cls = type(module)
    while cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1:
        cls = cls.__bases__[-1]
    if cls.__module__.startswith(_WRAPPER_PREFIXES):
        return None
    return cls


def _block_class(block: nn.Module) -> type | None:
    """A list entry's own class, under any wrapper around it (a checkpoint or compile wrapper)."""
    return next((cls for m in block.modules() if (cls := _user_class(m)) is not None), None)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_family(model: nn.Module) -> str:
    """A short hash of the model's structure without its sizes: the classes of its modules, and
    for each nn.ModuleList the class of its entries (how many there are is a size)."""
    classes = {_name(cls) for m in model.modules() if (cls := _user_class(m)) is not None}
    blocks = {f"{_name(type(m))}[{','.join(sorted({_name(c) for b in m if (c := _block_class(b)) is not None}))}]"
              for m in model.modules() if isinstance(m, nn.ModuleList)}
    text = "|".join(sorted(classes)) + "#" + "|".join(sorted(blocks))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def device_name() -> str:
    """"cuda: <GPU name>" on a GPU, else "cpu: <processor model>"."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda: {torch.cuda.get_device_name(torch.cuda.current_device())}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        model = ""
    import platform

    return f"cpu: {model or platform.processor() or platform.machine()}"
