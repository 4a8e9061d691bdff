"""`engine.save_16bit_model`: one consolidated state dict of the model, written by rank 0.

As in DeepSpeed, the weights are in the training precision (bf16 or fp16 when that is on, fp32
otherwise) and every rank must call it. Under FSDP2 (our stages 2 and 3) and tensor parallelism the
shards are gathered with torch.distributed.checkpoint's full state dict, so the file holds the whole
model (DeepSpeed's AutoTP at ZeRO 0-2 writes rank 0's shards alone, a file that does not load). At stage 3 DeepSpeed gathers only when
zero_optimization.stage3_gather_16bit_weights_on_model_save is true, and otherwise saves nothing
and returns False; scripts (Hugging Face's Trainer among them) rely on that, so we do the same.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    if not engine._fsdp and engine._split is None:
        return {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Offloading to host memory leaves the full tensors on rank 0 only; on a CPU they are there already.
    offload = engine.ctx.device.type == "cuda"
    return get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))


def save_16bit_model(engine: Any, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    path = Path(save_dir) / save_filename
    if engine.zero_stage == 3 and not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        logger.info("Did not save the model %s because stage3_gather_16bit_weights_on_model_save is False", path)
        return False
    state = _full_state_dict(engine)  # collective under FSDP2: every rank takes part
    frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad}
    dtype = _DTYPES.get(engine.precision)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state = {name: tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                 for name, tensor in state.items() if not (exclude_frozen_parameters and name in frozen)}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(state, handle)
            os.replace(partial, path)  # a reader never sees half a file
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    if dist.is_initialized():
        dist.barrier()  # the file exists for every rank once this returns
    return True
