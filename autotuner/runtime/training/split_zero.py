"""ZeRO 1 under tensor parallelism: torch's ZeroRedundancyOptimizer over the data-parallel group,
stepping plain "shadow" parameters that share storage with each split parameter's local shard.

ZeroRedundancyOptimizer broadcasts each updated parameter from the dp rank that owns it, and
DTensor has no rule for a broadcast, so it cannot hold the split DTensors themselves. A shadow
is a Parameter over the same storage as the DTensor's local tensor (a whole parameter is its
own shadow): the optimizer's update and the owner's broadcast land in the model's shards. The
ranks of one dp group hold the same tp rank's shards, so their shadows line up. At each
boundary the engine hands every gradient's local tensor to its shadow (`hand_gradients`) after
averaging them over dp, and drops the model's gradients with the shadows'.

For a DCP checkpoint the optimizer is shown as the model's (`as_model_parameters`): its params
and state keyed by the model's parameters, the split ones' state as DTensors with their
parameter's placements, so DCP writes each tp rank's slice once; afterwards it is put back.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class SplitShadows:
    """Each split parameter with its shadow (by the shadow), in the order the optimizer's groups list them."""

    pairs: tuple[tuple[nn.Parameter, nn.Parameter], ...]  # (the model's parameter, its shadow)

    @classmethod
    def over(cls, groups: list[dict[str, Any]]) -> tuple["SplitShadows", list[dict[str, Any]]]:
        """Shadows for the parameters of `groups`, and the groups holding the shadows instead."""
        pairs, shadowed = [], []
        for group in groups:
            params = []
            for param in group["params"]:
                shadow = param
                if hasattr(param, "to_local"):
                    shadow = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                pairs.append((param, shadow))
                params.append(shadow)
            shadowed.append({**group, "params": params})
        return cls(tuple(pairs)), shadowed

    def hand_gradients(self) -> None:
        """Each shadow's gradient is its parameter's local gradient (the same storage: a clip or an
        unscale of either is the other's)."""
        for param, shadow in self.pairs:
            if shadow is not param:
                shadow.grad = None if param.grad is None else _local(param.grad)

    def drop_gradients(self) -> None:
        for param, shadow in self.pairs:
            param.grad = None
            shadow.grad = None

    @contextlib.contextmanager
    def as_model_parameters(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """`optimizer` (a rank's partition) keyed by the model's parameters while the block runs, the
        split ones' state as DTensors; then back on the shadows, with whatever state it holds then
        (a load's) as local tensors."""
        to_param = {id(shadow): param for param, shadow in self.pairs if shadow is not param}
        to_shadow = {id(param): shadow for param, shadow in self.pairs if shadow is not param}
        originals = list(optimizer.param_groups)
        groups = [list(group["params"]) for group in originals]
        for group in optimizer.param_groups:
            group["params"] = [to_param.get(id(p), p) for p in group["params"]]
        optimizer.state = defaultdict(dict, {to_param.get(id(p), p): _as_split(state, to_param.get(id(p)), p)
                                             for p, state in optimizer.state.items()})
        try:
            yield
        finally:
            optimizer.state = defaultdict(dict, {to_shadow.get(id(p), p): {k: _local(v) if torch.is_tensor(v) else v
                                                                            for k, v in state.items()}
                                                 for p, state in optimizer.state.items()})
            # The group dicts themselves stay (ZeroRedundancyOptimizer's partition holds them); a load
            # made new ones, whose hyperparameters they take.
            for group, now, params in zip(originals, optimizer.param_groups, groups):
                group.update({key: value for key, value in now.items() if key != "params"})
                group["params"] = params
            optimizer.param_groups = originals


def _as_split(state: dict[str, Any], param: nn.Parameter | None, shadow: torch.Tensor) -> dict[str, Any]:
    """A shadow's optimizer state with each tensor shaped like it (Adam's moments) as a DTensor laid
    out as `param`; scalars (the step count) as they are. Whole parameters' state unchanged."""
    if param is None:
        return state
    from torch.distributed.tensor import DTensor

    return {key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                    shape=param.shape, stride=param.stride())
            if torch.is_tensor(value) and value.shape == shadow.shape and value.dim() > 0 else value
            for key, value in state.items()}
