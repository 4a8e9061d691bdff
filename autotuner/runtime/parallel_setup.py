"""The ranks' parallel layout as initialize sets it up: from the config's tensor_parallel section
(collective: it builds the mesh), checked against what the script passed (an mpu, tp_model_init's
tp_group), so that the script's groups and the engine's are one layout."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError, UnsupportedError
from autotuner.runtime.distributed import warn_once
from autotuner.runtime.tp_init import set_autotp_mode
from autotuner.runtime.training.tensor_parallel import (ParallelLayout, parallel_layout, refuse_on_device,
                                                         register_layout)


def layout_for(cfg: DeepSpeedConfig, ctx: Any, stage: int) -> ParallelLayout:
    """The ranks' (dp, tp) layout from the config's tensor_parallel section (collective)."""
    tp = cfg.tensor_parallel.size
    if tp > 1:
        refuse_on_device(cfg.tensor_parallel.keep_module_on_host, ctx.device)
        if cfg.tensor_parallel.tp_overlap_comm:
            warn_once("tensor_parallel.tp_overlap_comm: DeepSpeed's overlap of a column layer's input-gradient "
                      "all-reduce with its weight gradient is a speed knob that torch's DTensor does not offer; "
                      "the same math runs without it")
    layout = parallel_layout(ctx, tp)
    given = cfg.data_parallel_size
    if given is not None and given != layout.dp_size:
        raise ConfigError(f"data_parallel_size {given}: the world of {ctx.world_size} ranks over "
                          f"tensor_parallel.autotp_size {tp} gives {layout.dp_size}; fix it or leave it out")
    if layout.tensor_parallel:  # deepspeed.utils.groups answers with it from now on, as DeepSpeed's engine sets it
        register_layout(layout)
        set_autotp_mode(training=True)
    return layout


def check_mpu(mpu: Any, mesh_param: Any, layout: ParallelLayout) -> None:
    """An mpu is honoured where it describes the config's layout: DeepSpeed reads its data-parallel
    size for the batch and then uses its own groups (consecutive TP ranks), which must then be the
    script's groups too. Anything else is refused in one line."""
    if mesh_param is not None:
        raise UnsupportedError("initialize(mesh_param=...): data/sequence-parallel meshes are not supported; "
                               "give tensor_parallel.autotp_size in the config instead")
    if mpu is None:
        return
    tp = layout.tp_size
    model = getattr(mpu, "get_model_parallel_world_size", lambda: None)()
    if (tp == 1 and model != 1) or (tp > 1 and model not in (None, tp)):
        raise UnsupportedError(f"initialize(mpu=...): the mpu's model-parallel world size is {model} but the config's "
                               f"tensor_parallel.autotp_size gives {tp}; set autotp_size to the script's tensor-parallel "
                               "size (autotuner splits the model by it), or pass mpu=None")
    data = getattr(mpu, "get_data_parallel_world_size", lambda: None)()
    if data is not None and data != layout.dp_size:
        raise UnsupportedError(f"initialize(mpu=...): the mpu's data-parallel world size is {data}, but world / "
                               f"autotp_size is {layout.dp_size}")
    group = getattr(mpu, "get_model_parallel_group", lambda: None)()
    if tp > 1 and group is not None:
        ranks = dist.get_process_group_ranks(group)
        expected = list(range(layout.tp_source_rank, layout.tp_source_rank + tp))
        if ranks != expected:
            raise UnsupportedError(f"initialize(mpu=...): this rank's tensor-parallel group is ranks {ranks}; DeepSpeed "
                                   f"and autotuner put consecutive ranks together ({expected}), and the batches "
                                   "would not match; build the groups that way")


def check_tp_group(tp_group: Any, layout: ParallelLayout) -> None:
    """tp_model_init's tp_group must be this rank's group of the layout (consecutive ranks), as an mpu's must."""
    if tp_group is None or not layout.tensor_parallel:
        return
    ranks = dist.get_process_group_ranks(tp_group)
    expected = list(range(layout.tp_source_rank, layout.tp_source_rank + layout.tp_size))
    if ranks != expected:
        raise UnsupportedError(f"tp_model_init(tp_group=...): this rank's group is ranks {ranks}; DeepSpeed and "
                               f"autotuner put consecutive ranks together ({expected}), and the batches would not "
                               "match; build the group that way")
