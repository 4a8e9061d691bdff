"""`deepspeed.utils.groups`: the tensor- and data-parallel groups at DeepSpeed 0.19.8's names.

They answer from the (dp, tp) layout this process trains with (runtime/training/tensor_parallel.py):
the one `initialize` built under `tensor_parallel.autotp_size` above 1, or the one
`_init_tp_mesh_device` built before it, which `initialize` then reuses. The ranks of a TP group are
consecutive, as in DeepSpeed. The model-parallel group is the tensor-parallel group, as in
DeepSpeed's AutoTP. Before either builds a layout, and after an `initialize` without tensor
parallelism, there are no such groups, and each function refuses in one line, where DeepSpeed's
asserts that its group is not initialized.
"""

from __future__ import annotations

from typing import Any

from autotuner.core.errors import UsageError
from autotuner.runtime.training.tensor_parallel import ParallelLayout, current_layout, mesh_layout, register_layout

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size"]


def _layout(caller: str) -> ParallelLayout:
    layout = current_layout()
    if layout is None:
        raise UsageError(f"deepspeed.utils.groups.{caller}(): the tensor-parallel groups are not built; "
                         "deepspeed.initialize builds them under tensor_parallel.autotp_size above 1, and "
                         "groups._init_tp_mesh_device(tensor_model_parallel_size) before it")
    return layout


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> Any:
    """Build the (dp, tp) groups now (collective: every rank calls it), consecutive ranks in a TP
    group; returns (data-parallel group, model-parallel group). Where they exist already it does
    nothing and returns None, as DeepSpeed's does; initialize trains on them, and refuses a config
    whose autotp_size is another size."""
    import torch.distributed as dist

    from autotuner.runtime.distributed import init_distributed

    if current_layout() is not None:
        return None
    if not dist.is_initialized():
        raise UsageError("deepspeed.utils.groups._init_tp_mesh_device(): the process group is not initialised; "
                         "call deepspeed.init_distributed() first")
    layout = mesh_layout(init_distributed(), tensor_model_parallel_size, data_parallel_size,
                         what="groups._init_tp_mesh_device: tensor_model_parallel_size")
    register_layout(layout)
    return layout.dp_group, layout.tp_group


def get_tensor_model_parallel_group() -> Any:
    return _layout("get_tensor_model_parallel_group").tp_group


def get_model_parallel_group() -> Any:
    return _layout("get_model_parallel_group").tp_group


def get_data_parallel_group() -> Any:
    return _layout("get_data_parallel_group").dp_group


def get_tensor_model_parallel_world_size() -> int:
    return _layout("get_tensor_model_parallel_world_size").tp_size


def get_model_parallel_world_size() -> int:
    return _layout("get_model_parallel_world_size").tp_size


def get_tensor_model_parallel_rank() -> int:
    return _layout("get_tensor_model_parallel_rank").tp_rank


def get_model_parallel_rank() -> int:
    return _layout("get_model_parallel_rank").tp_rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's TP group: (rank // tp) * tp."""
    return _layout("get_tensor_model_parallel_src_rank").tp_source_rank


def get_data_parallel_world_size() -> int:
    return _layout("get_data_parallel_world_size").dp_size


def get_data_parallel_rank() -> int:
    return _layout("get_data_parallel_rank").dp_rank
