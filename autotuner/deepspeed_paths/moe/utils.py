"""`deepspeed.moe.utils`: what is well defined without expert parallelism behaves as DeepSpeed's."""

from __future__ import annotations

from typing import Any

from autotuner.deepspeed_paths.unsupported import refuse


def is_moe_param(param: Any) -> bool:
    """DeepSpeed marks an expert's parameters with `allreduce = False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                          max_group_size: int | float = 178956971) -> Any:
    """DeepSpeed moves expert parameters into groups of their own. A model with none (every model
    here: MoE layers are refused) gets its groups back unchanged, as DeepSpeed returns them."""
    groups = [param_groups] if isinstance(param_groups, dict) else param_groups
    for group in groups:
        params = group["params"] if isinstance(group, dict) else [group]
        if any(is_moe_param(p) for p in params):
            raise refuse("moe")
    return param_groups
