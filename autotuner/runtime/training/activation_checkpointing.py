"""Activation checkpointing of the model's repeated blocks (`activation_checkpointing.policy`).

The blocks are the entries of the model's nn.ModuleLists, the units FSDP2 shards, outermost
only (a block's own lists are inside its checkpoint already). Each gets torch's composable
`checkpoint` (torch.utils.checkpoint's non-reentrant form as forward hooks), which keeps the
parameters' names, so DCP checkpoints and optimizer groups are the same under every policy.
It is applied before DDP or FSDP2 wrap the model, torchtitan's order.

- "full": a block keeps only its input; everything inside is recomputed in backward.
- "selective": matmul outputs are kept too (torch's selective-checkpoint contexts, as
  torchtitan's op policy); pointwise ops, norms and activations are recomputed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from autotuner.runtime.distributed import warn_once

POLICIES = ("none", "full", "selective")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of every nn.ModuleList that sits in no other chosen block, in model order."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for block in module:
            blocks.append(block)
            inside.update(id(m) for m in block.modules())
    return blocks


@functools.cache
def _kept_ops() -> frozenset:
    """The aten ops whose outputs "selective" keeps: the matmuls and attention kernels, which cost
    the most to recompute for the bytes they hold."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def apply_activation_checkpointing(model: nn.Module, policy: str) -> int:
    """Checkpoint `model`'s repeated blocks in place under `policy`; returns how many. A model
    without repeated blocks trains as it is, with one line saying so."""
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy {policy!r}; expected one of {POLICIES}")
    if policy == "none":
        return 0
    blocks = repeated_blocks(model)
    if not blocks:
        warn_once(f"activation_checkpointing.policy \"{policy}\": the model has no repeated blocks (no "
                  "nn.ModuleList), so nothing is checkpointed; training without activation checkpointing")
        return 0
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        # Hugging Face models append to a key/value cache in forward; the recompute would run
        # other ops than the forward did (selective checkpointing then fails in backward).
        # transformers turns the cache off under its own gradient checkpointing; so do we.
        config.use_cache = False
        warn_once(f"activation_checkpointing.policy \"{policy}\": the model's config.use_cache set to False, as "
                  "transformers does under gradient checkpointing")
    from torch.distributed._composable import checkpoint

    context_fn = _selective_contexts if policy == "selective" else None
    for block in blocks:
        checkpoint(block, context_fn=context_fn)
    return len(blocks)
