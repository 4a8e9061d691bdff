"""Whole weights where a DeepSpeed script expects them, under FSDP2 (our ZeRO 2 and 3).

DeepSpeed-Chat and scripts like it read the model's weights in two ways, both of which would see
FSDP2's DTensor shards here and write a file of shards:

- rank 0 alone saves `model.module.state_dict()`. Under DeepSpeed's ZeRO 2 the parameters are not
  partitioned, so that is the whole model. Here a state-dict hook on the user's module gives rank 0
  whole tensors, gathered by the rank-zero service (rank_zero_gather.py), which the other ranks run
  from a thread. torch.distributed.checkpoint's helpers (ours, or a script's, on every rank) still
  get the shards they gather themselves.
- at ZeRO 3 every rank enters `deepspeed.zero.GatheredParameters(params, modifier_rank=...)` for
  parameters that carry DeepSpeed's markers (`ds_id`, `ds_status`, `ds_shape`, `ds_numel`), reads
  `param.data` (or the module's attribute) inside, and with a modifier rank changes it there.
  `Gathering` is that context on DTensor parameters: on entry each is all-gathered whole
  (DTensor.full_tensor, in the shards' precision); the module holds the whole parameter in its
  place and the sharded parameter's `.data` reads it; on exit, with a modifier rank, that rank's
  whole value is scattered back into every rank's shard (distribute_tensor), and without one
  changes are dropped, as DeepSpeed drops them.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from enum import Enum
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autotuner.core.errors import UnsupportedError
from autotuner.runtime.training.sharding import is_dtensor


class ZeroParamStatus(Enum):
    """DeepSpeed's names for a ZeRO-3 parameter's state (deepspeed.runtime.zero.partition_parameters)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# ----- DeepSpeed's markers on ZeRO-3 parameters -----
def mark_zero3_parameters(module: nn.Module) -> None:
    """Give each sharded parameter DeepSpeed's ZeRO-3 markers, which scripts test before gathering
    (`hasattr(p, "ds_id")`, `p.ds_status == ZeroParamStatus.NOT_AVAILABLE`)."""
    for index, param in enumerate(p for p in module.parameters() if is_dtensor(p)):
        param.ds_id = index
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        param.ds_shape = param.shape
        param.ds_numel = param.numel()


# ----- rank 0's state dict -----
def _for_torch_checkpoint() -> bool:
    """Whether torch.distributed.checkpoint is asking (its state-dict helpers, ours or a script's):
    a collective over the shards on every rank, which whole tensors on rank 0 alone would hang."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False


def whole_state_dict_on_rank_zero(module: nn.Module, rank: int, service: Any) -> None:
    """Hook `module.state_dict()` so that on rank 0 it holds whole tensors (see the module's docstring);
    other ranks, and `keep_vars=True`, still get the shards."""

    def hook(_module: nn.Module, state: dict, prefix: str, _metadata: Any) -> dict | None:
        if prefix or not any(is_dtensor(v) for v in state.values()) or _for_torch_checkpoint():
            return None
        if any(isinstance(v, nn.Parameter) for v in state.values()):
            return None  # keep_vars=True: the caller wants the parameters themselves
        return whole_tensors(state, service)

    if rank == 0:
        module._register_state_dict_hook(hook)


def whole_tensors(state: dict, service: Any) -> dict:
    """`state` with every DTensor shard replaced by the whole tensor: local where one rank holds it
    all, else from the rank-zero service on rank 0; refused in one line without the service or on
    another rank."""
    sharded = [key for key, value in state.items() if is_dtensor(value)]
    if not sharded:
        return state
    if all(state[key].device_mesh.size() == 1 for key in sharded):
        return OrderedDict((key, value.to_local() if is_dtensor(value) else value) for key, value in state.items())
    if service is None or service.rank != 0:
        where = "on rank 0 alone" if service is None else f"on rank {service.rank}: only rank 0 is served"
        key = next(key for key in sharded if state[key].device_mesh.size() > 1)  # (one rank's DTensors are whole)
        how = "split by tensor_parallel" if _tensor_parallel(state[key]) else "sharded (ZeRO stage 2/3 here is FSDP2)"
        raise UnsupportedError(f"state_dict: {key} is {how} over {state[key].device_mesh.size()} ranks and cannot "
                               f"be gathered {where}; save with engine.save_16bit_model(dir) on every rank")
    return service.whole_state_dict(state)


def _tensor_parallel(value: DTensor) -> bool:
    names = value.device_mesh.mesh_dim_names or ()
    return "tp" in names or value.device_mesh.ndim > 1


# ----- GatheredParameters on DTensor parameters -----
_roots: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def register_root(module: nn.Module) -> None:
    """A model FSDP2 sharded at initialize: where a gathered parameter is looked for on the modules."""
    _roots.add(module)


class _GatheredDTensor(DTensor):
    """A sharded parameter while it is gathered: `.data` is the whole tensor (DeepSpeed's parameter
    holds its whole data inside GatheredParameters; scripts read and write it through `.data`)."""

    __slots__ = ()

    @property
    def data(self) -> torch.Tensor:
        return self.__dict__["_autotuner_whole"].data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        whole = self.__dict__["_autotuner_whole"]
        if value is not whole and value.data_ptr() != whole.data_ptr():
            whole.data.copy_(value)


def _owners(params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each parameter is registered in the sharded models: (module, attribute name) pairs, by
    the parameter's id (a module reads the gathered parameter through its attribute)."""
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for root in list(_roots):
        for module in root.modules():
            for name, value in module._parameters.items():
                if value is not None and id(value) in wanted:
                    found.setdefault(id(value), []).append((module, name))
    return found


class Gathering:
    """One `GatheredParameters` context over DTensor parameters (collective: every rank enters it)."""

    def __init__(self, params: Iterable[Any], modifier_rank: int | None):
        params = list(params)
        for param in params:  # whole tensors need nothing; one that holds no values cannot be gathered
            if isinstance(param, torch.Tensor) and param.is_meta:
                raise UnsupportedError(f"GatheredParameters: a parameter of shape {tuple(param.shape)} is on the "
                                       "meta device (no values on any rank); materialise the model before gathering")
        # A parameter an enclosing context gathered stays its: whole already, as in DeepSpeed.
        self.params = list(dict.fromkeys(p for p in params if is_dtensor(p) and type(p) is not _GatheredDTensor))
        self.modifier_rank = modifier_rank
        self._whole: list[nn.Parameter] = []
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}

    def __enter__(self) -> None:
        self._owners = _owners(self.params)
        for param in self.params:
            whole = nn.Parameter(param.full_tensor().detach().clone(), requires_grad=param.requires_grad)
            for marker in ("ds_id", "ds_shape", "ds_numel"):
                if marker in param.__dict__:
                    setattr(whole, marker, param.__dict__[marker])
            whole.ds_status = ZeroParamStatus.AVAILABLE
            self._whole.append(whole)
            for module, name in self._owners.get(id(param), ()):
                module._parameters[name] = whole
            param.__dict__["_autotuner_whole"] = whole
            param.__class__ = _GatheredDTensor
            if "ds_status" in param.__dict__:
                param.ds_status = ZeroParamStatus.AVAILABLE

    def __exit__(self, kind: Any, *_exc: Any) -> None:
        from torch.distributed.tensor import distribute_tensor

        try:
            if self.modifier_rank is not None and kind is None:
                for param, whole in zip(self.params, self._whole):
                    mesh_rank = param.device_mesh.get_local_rank() if param.device_mesh.ndim == 1 else None
                    if mesh_rank is None:
                        raise UnsupportedError("GatheredParameters: only FSDP2's one-dimensional mesh is written back")
                    source = whole.detach().to(param.to_local().device, param.dtype)
                    written = distribute_tensor(source, param.device_mesh, param.placements,
                                                src_data_rank=self.modifier_rank)
                    with torch.no_grad():
                        param.to_local().copy_(written.to_local())
        finally:
            for param in self.params:
                param.__class__ = DTensor
                param.__dict__.pop("_autotuner_whole", None)
                if "ds_status" in param.__dict__:
                    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
                for module, name in self._owners.get(id(param), ()):
                    module._parameters[name] = param
            self._whole = []
