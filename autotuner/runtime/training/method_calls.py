"""Methods of the user's model that a script calls through the engine, run as its forward runs.

DeepSpeed's engine passes unknown attributes to the model, and scripts call model methods other
than `forward` through it: DeepSpeed-Chat's PPO trainer trains its critic through
`critic_engine.forward_value(...)`. The engine's forward sets up two things such a call also needs:

- stages 0-1 in bf16/fp16: the engine's autocast (its forward computes in the config's precision);
- stages 2-3 (FSDP2): the root unit's parameters (those outside the sharded blocks: embeddings, final
  norm, a value head) are gathered only around the root's `forward`. DeepSpeed gathers in hooks on
  every submodule, so any method works there. Here, inside a method reached through the engine,
  the first time a module of the root unit runs, FSDP2's own pre-forward of the root is run (the
  all-gather, and the backward hooks), and its post-forward on the method's result (the reshard,
  and the pre-backward hooks that gather again for backward): what `register_fsdp_forward_method`
  does, started lazily, so that the collective happens exactly where DeepSpeed's per-module
  hooks would gather, and a method that runs no module (`save_pretrained` on rank 0) gathers
  nothing. Methods that run the root's own `forward` (`generate`) gather through its hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn


def root_unit_modules(root: nn.Module) -> list[nn.Module]:
    """Modules whose own parameters FSDP2's root unit holds: not inside a block sharded on its own."""
    from torch.distributed.fsdp import FSDPModule

    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if module is not root and isinstance(module, FSDPModule):
            return  # its own unit: its forward gathers its parameters
        if any(param is not None for param in module._parameters.values()):
            found.append(module)
        for child in module.children():
            visit(child)

    visit(root)
    return found


class LazyRootGather:
    """FSDP2's root pre-/post-forward around a method, started when a root-unit module first runs."""

    def __init__(self, root: nn.Module):
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self._root = root
        self._state = root._get_fsdp_state()
        self._idle = TrainingState.IDLE
        self._depth = 0
        self._owed = False  # a pre-forward ran inside the outermost method: its post-forward is owed
        for module in root_unit_modules(root):
            module.register_forward_pre_hook(self._before_module)

    def _before_module(self, _module: nn.Module, _args: Any) -> None:
        if self._depth and self._state._training_state == self._idle:
            self._state._pre_forward(self._root, (), {})
            self._owed = True

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._depth += 1
        try:
            output = method(*args, **kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._owed:
            self._owed = False
            output = self._state._post_forward(self._root, (), output)
        return output


class MethodCalls:
    """How the engine runs a model method a script reaches through it (module docstring)."""

    def __init__(self, root: nn.Module, autocast_dtype: torch.dtype | None, device: torch.device,
                 before_call: Callable[[], None]):
        from torch.distributed.fsdp import FSDPModule

        self._gather = LazyRootGather(root) if isinstance(root, FSDPModule) else None
        self._autocast = autocast_dtype
        self._device = device
        self._before_call = before_call

    @property
    def needed(self) -> bool:
        return self._gather is not None or self._autocast is not None

    def wrap(self, bound: Callable[..., Any]) -> "EngineMethod":
        return EngineMethod(self, bound)

    def call(self, bound: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._before_call()
        autocast = torch.autocast(self._device.type, dtype=self._autocast) if self._autocast is not None \
            else contextlib.nullcontext()
        with autocast:
            if self._gather is not None:
                return self._gather.call(bound, *args, **kwargs)
            return bound(*args, **kwargs)


class EngineMethod:
    """The model's bound method as the engine calls it; reads as that method otherwise (`__func__`,
    `__self__`, `__name__`, and inspect.signature through `__wrapped__`)."""

    def __init__(self, calls: MethodCalls, bound: Callable[..., Any]):
        self._calls = calls
        self.__wrapped__ = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._calls.call(self.__wrapped__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["__wrapped__"], name)

    def __repr__(self) -> str:
        return f"<engine call of {self.__wrapped__!r}>"
