"""torch.compile of the model's repeated blocks (the `compile` section, or `engine.compile()`).

Each block (the outermost nn.ModuleList entries, as activation checkpointing and FSDP2 find
them) is compiled in place with `nn.Module.compile`, which keeps parameter names, so
checkpoints and optimizer groups are those of the eager model. Before DDP/FSDP2 wrap the
model, as torchtitan does (checkpointing, then compile, then sharding): a block compiles once
and its graph holds no collective. A model without repeated blocks is compiled whole.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from autotuner.runtime.training.activation_checkpointing import repeated_blocks


def compile_blocks(model: nn.Module, backend: str = "inductor", kwargs: dict[str, Any] | None = None) -> int:
    """Compile `model`'s repeated blocks in place (the model itself when it has none); returns how
    many modules were compiled. Compiling happens at each block's first call."""
    targets = repeated_blocks(model) or [model]
    for module in targets:
        module.compile(backend=backend, **(kwargs or {}))
    return len(targets)


def is_compiled(model: nn.Module) -> bool:
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
