"""`autotuner.comm`: the process-group calls training scripts make through `deepspeed.comm`.

Each is torch.distributed underneath, with DeepSpeed's names, argument names and defaults
(`all_gather_into_tensor(output_tensor, tensor)`, `get_local_rank()` from the launcher's
environment, a default timeout from DEEPSPEED_TIMEOUT minutes). The collectives take DeepSpeed's
`prof`, `log_name` and `debug`, which label its communication log; we keep no such log, so they
change nothing. `ReduceOp` is torch's, so `ReduceOp.SUM` reads the same either way. Where a
signature still differs from DeepSpeed 0.19.8's, docs/deepspeed_signatures.md says why.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from autotuner.core.errors import UsageError
from autotuner.runtime.deepspeed_side import follow_with_deepspeed_comm
from autotuner.runtime.distributed import init_distributed as _join

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "gather", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed", "irecv", "is_available",
    "is_initialized", "isend", "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter_tensor", "scatter",
    "send", "allgather_fn", "has_all_gather_into_tensor",
]


def _default_timeout() -> datetime.timedelta:
    return datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", 10)))


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """deepspeed.init_distributed: join the launcher's process group (a no-op when one exists).
    Without launcher variables it forms a world of one; MPI discovery is not attempted. Should
    DeepSpeed's own package load later (transformers builds a model under its zero.Init), its comm
    joins the same group, as this call would have made it on DeepSpeed (deepspeed_side.py)."""
    if not dist.is_initialized():
        _init(dist_backend, distributed_port, timeout, init_method, dist_init_required, rank, world_size)
    follow_with_deepspeed_comm(dist.get_backend())


def _init(dist_backend: str | None, distributed_port: int, timeout: datetime.timedelta | None,
          init_method: str | None, dist_init_required: bool | None, rank: int, world_size: int) -> None:
    if dist_init_required is False:
        raise UsageError("init_distributed(dist_init_required=False): no process group is initialised; "
                         "leave dist_init_required unset")
    if dist_backend == "nccl" and not torch.cuda.is_available():
        dist_backend = "gloo"  # what DeepSpeed's CPU accelerator picks; nccl cannot run here
    _join((timeout or _default_timeout()).total_seconds(), default_port=distributed_port, backend=dist_backend,
          init_method=init_method, rank=rank, world_size=world_size)


def _require() -> None:
    if not dist.is_initialized():
        raise UsageError("autotuner.comm: the process group is not initialised; call "
                         "autotuner.init_distributed() or autotuner.initialize() first")


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    _require()
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    _require()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    _require()
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    _require()
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> Any:
    _require()
    return dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    _require()
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, prof: bool = False,
            log_name: str = "barrier", debug: str | None = None) -> Any:
    # DeepSpeed's barrier drops device_ids; so do we.
    _require()
    return dist.barrier(group=group, async_op=async_op)


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: str | None = None) -> Any:
    _require()
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: str | None = None) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None, prof: bool = False,
                          log_name: str = "broadcast_object_list", debug: str | None = None) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False,
               log_name: str = "all_reduce", debug: str | None = None) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False,
           log_name: str = "reduce", debug: str | None = None) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_gather", debug: str | None = None) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: str | None = None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False,
                           log_name: str = "all_gather_into_tensor", debug: str | None = None) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: str | None = None) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list | None = None,
                      input_split_sizes: list | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: str | None = None) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: str | None = None) -> Any:
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: str | None = None) -> Any:
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: str | None = None) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: str | None = None) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: str | None = None) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: str | None = None) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def has_all_gather_into_tensor() -> bool:
    """Whether all_gather_into_tensor exists: it does in every torch this runs on."""
    _require()
    return hasattr(dist, "all_gather_into_tensor")


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False,
                 debug: str | None = None) -> Any:
    """DeepSpeed's gather of equal shards into one flat tensor: all_gather_into_tensor."""
    _require()
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
