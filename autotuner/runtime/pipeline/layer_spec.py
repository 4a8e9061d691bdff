"""`deepspeed.pipe.LayerSpec` and `TiedLayerSpec` as DeepSpeed defines them: a layer described,
built only on the stage that holds it; and what partitioning reads of a layer (its name for
"type:REGEX", its trainable parameters for "parameters")."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

class LayerSpec:
    """A layer to build later, on the stage that holds it: `typename(*args, **kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")  # DeepSpeed's words
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = dist.get_rank() if dist.is_initialized() else -1

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` weights are one weight wherever `key` appears; at a later
    appearance `forward_fn(module, x)` runs instead of the module's own forward, where given (an
    embedding used as the output head)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def layer_name(layer: Any) -> str:
    """What "type:REGEX" partitioning matches: a spec's class, a module's class, a function's name."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")


def trainable_count(layer: Any) -> int:
    """A layer's trainable parameters, as "parameters" partitioning weighs it. A spec is built on
    the meta device to count (nothing allocated; DeepSpeed builds it for real on every rank)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # a constructor that cannot run on meta: built as DeepSpeed builds it
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0
