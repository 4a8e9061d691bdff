"""A model transformers built under DeepSpeed's own zero.Init, trained on our engine.

DeepSpeed-Chat builds its model while a transformers `HfDeepSpeedConfig` at ZeRO stage 3 is alive,
and transformers then builds it under DeepSpeed's zero.Init (`import deepspeed` inside
`from_config`/`from_pretrained`: DeepSpeed's package, whatever the script imported). Two things
make that work here, with DeepSpeed's own API only:

- DeepSpeed's comm is pointed at our process group as soon as DeepSpeed loads, as the script's
  `deepspeed.init_distributed()` would have done on DeepSpeed (its Init reads the world size
  there, broadcasts rank 0's initial weights and partitions them over it);
- at initialize the parameters it partitioned are gathered whole with DeepSpeed's
  `GatheredParameters` and put back as ordinary parameters (in fp32 where its Init cast them to the
  config's bf16 or fp16, the values DeepSpeed's fp32 master weights start from), which FSDP2 (or
  DDP) then wraps as it wraps any model. The optimizer the script built on the partitioned ones is
  mapped by name.

Both need code run the moment DeepSpeed's own package has loaded in this process (now, if it has),
as does the measurement of a script on DeepSpeed's engine (measure/deepspeed_measure.py):
`when_deepspeed_loads` serves them (core/import_hooks.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

import torch
import torch.nn as nn

from autotuner.core.import_hooks import when_loaded
from autotuner.runtime.distributed import warn_once


# ----- when DeepSpeed loads -----
def when_deepspeed_loads(callback: Callable[[], None]) -> None:
    """Call `callback()` once `deepspeed` (DeepSpeed's own package) has been imported."""
    when_loaded("deepspeed", callback,
                loaded=lambda: "deepspeed" in sys.modules and "deepspeed.runtime.engine" in sys.modules)


# ----- DeepSpeed's comm, and its partitions gathered -----
_SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory collectives (its ShareMemCommBuilder.NAME)


def follow_with_deepspeed_comm(backend: str) -> None:
    """Once DeepSpeed loads in this process, initialise its comm on the process group we set up."""

    def join() -> None:
        deepspeed = sys.modules["deepspeed"]
        if deepspeed.comm.is_initialized():
            return
        # Without DeepSpeed's CPU shared-memory allreduce, whose setup waits for every rank's buffer:
        # joining stays local to this rank, so a rank that alone imports DeepSpeed (transformers does
        # inside rank 0's save_pretrained) does not hang. DeepSpeed's comm here carries only its
        # zero.Init's broadcasts and its GatheredParameters, which torch's collectives serve.
        compatible = getattr(deepspeed.ops, "__compatible_ops__", {})
        before = compatible.get(_SHM_OP)
        compatible[_SHM_OP] = False
        try:
            deepspeed.comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        finally:
            if before is None:
                compatible.pop(_SHM_OP, None)
            else:
                compatible[_SHM_OP] = before

    when_deepspeed_loads(join)


def unlink_shm_buffer(on_cpu: bool) -> None:
    """On CPU, DeepSpeed's comm (its shared-memory allreduce) creates /dev/shm/deepspeed_allreduce_buffer_
    <uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (66 MiB) per rank and never unlinks it: in RAM, and a new
    name for every launch's port, so runs would fill memory with them. Once every rank has mapped
    every buffer (after DeepSpeed's comm or engine is set up, behind a barrier) the names are not
    needed: each rank unlinks its own, and the memory goes when the last rank that maps it exits.
    Collective where DeepSpeed's shm op exists (it is one build for all ranks)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not on_cpu or not addr or not port or not dist.is_initialized():
        return
    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if getattr(backend, "shm_comm_op", None) is None:
        return  # no shm op on any rank: nothing was created
    dist.barrier()
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def partitioned_by_deepspeed(model: nn.Module) -> list[nn.Parameter]:
    """Parameters DeepSpeed's zero.Init partitioned (its `ds_tensor`; our own markers never set one)."""
    return [p for p in model.parameters() if "ds_tensor" in p.__dict__]


def _master(data: torch.Tensor) -> torch.Tensor:
    """A whole copy in fp32 where DeepSpeed's Init cast it to the config's bf16 or fp16: DeepSpeed
    then keeps fp32 master weights made from those values, and our engine keeps its parameters in
    fp32 and computes in the config's precision."""
    copy = data.detach().clone()
    return copy.float() if copy.dtype in (torch.bfloat16, torch.float16) else copy


def gather_deepspeed_partitions(model: nn.Module) -> None:
    """Replace every parameter DeepSpeed's zero.Init partitioned with an ordinary whole one, in
    every module that registers it (tied weights stay tied). Collective over DeepSpeed's group."""
    partitioned = partitioned_by_deepspeed(model)
    if not partitioned:
        return
    warn_once("the model was built under DeepSpeed's own zero.Init (transformers does so while an "
              "HfDeepSpeedConfig at ZeRO stage 3 is alive): its partitions are gathered whole at initialize and "
              "sharded by this engine's ZeRO stage")
    deepspeed = sys.modules["deepspeed"]
    with deepspeed.zero.GatheredParameters(partitioned):
        whole = {id(p): nn.Parameter(_master(p.data), requires_grad=p.requires_grad) for p in partitioned}
    # Parameters made later from the cast ones (transformers' resize_token_embeddings) carry their
    # bf16 or fp16 without being partitioned: fp32 as well.
    for param in model.parameters():
        if id(param) not in whole and param.dtype in (torch.bfloat16, torch.float16):
            whole[id(param)] = nn.Parameter(_master(param.data), requires_grad=param.requires_grad)
    for module in model.modules():
        for name, value in list(module._parameters.items()):
            if value is not None and id(value) in whole:
                module._parameters[name] = whole[id(value)]
