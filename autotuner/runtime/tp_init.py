"""`deepspeed.tp_model_init` and `deepspeed.set_autotp_mode`, as DeepSpeed 0.19.8 has them.

In 0.19.8 `tp_model_init` no longer splits anything: it notes its tensor-parallel size, dtype and
optional `tp_group` for this process and hands the model back as it was; `initialize` then folds
what it noted into the config (`merge_into_config`), filling what the config leaves out and
refusing what contradicts it. A second call with other arguments is refused, as DeepSpeed refuses
it. What was noted stays for the process: a later `initialize` merges it again, as DeepSpeed's does.

`set_autotp_mode` picks DeepSpeed's AutoTP layers' training or inference behaviour. Our engine
only trains, and splits the model at `initialize` by the config whatever the mode, as DeepSpeed
(which sets training mode there itself) does; the mode is noted and has no other effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.config.models import DeepSpeedConfig
from autotuner.config.tensor_parallel import refuse_unsupported
from autotuner.core.errors import ConfigError, UsageError


@dataclass(frozen=True)
class TPModelInitArgs:
    tp_size: int
    dtype: Any
    tp_group: Any = None


_recorded: TPModelInitArgs | None = None
_training_mode = False


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's switch between its AutoTP layers' inference and training behaviour (noted only)."""
    global _training_mode
    _training_mode = bool(training)


def autotp_training_mode() -> bool:
    return _training_mode


def recorded_tp_model_init() -> TPModelInitArgs | None:
    return _recorded


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """Note `tp_size`, `dtype` and `tp_group=` (a keyword) for `initialize`, which splits the model;
    return `model` unchanged. `config` is taken and not read, as in DeepSpeed 0.19.8."""
    _record(TPModelInitArgs(tp_size, dtype, kwargs.get("tp_group")))
    set_autotp_mode(training=True)
    return model


def _group_size(group: Any) -> int | None:
    return dist.get_world_size(group=group) if group is not None and dist.is_initialized() else None


def _record(new: TPModelInitArgs) -> None:
    global _recorded
    old = _recorded
    if old is None:
        _recorded = new
        return
    same = (old.tp_size == new.tp_size and old.dtype == new.dtype
            and (old.tp_group is None) == (new.tp_group is None)
            and _group_size(old.tp_group) == _group_size(new.tp_group))
    if not same:
        raise UsageError(f"tp_model_init(tp_size={new.tp_size}, dtype={new.dtype}"
                         f"{', tp_group=...' if new.tp_group is not None else ''}): an earlier call in this process "
                         f"gave tp_size={old.tp_size}, dtype={old.dtype}"
                         f"{', tp_group=...' if old.tp_group is not None else ''}; call it with the same arguments")


_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# tensor_parallel.dtype as DeepSpeed names it in a file, and a torch.dtype given in a dict (the
# config loader keeps it as its str()).
_SECTION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                   **{str(dtype): dtype for dtype in (torch.float16, torch.bfloat16, torch.float32)}}


def merge_into_config(cfg: DeepSpeedConfig, mpu: Any) -> tuple[DeepSpeedConfig, Any]:
    """(the config with tp_model_init's arguments folded in, its tp_group or None), DeepSpeed's
    merge: the config's values win, tp_model_init fills `tensor_parallel.autotp_size` and
    `tensor_parallel.tp.tp_size` where the config lacks them, and any disagreement (size, dtype
    against bf16/fp16 or `tensor_parallel.dtype`, a tp_group beside an mpu) is refused in one line.
    `cfg` must have its precision settled. Without a tp_model_init call the config comes back as it was."""
    args = _recorded
    if args is None:
        return cfg, None
    if args.tp_group is not None and mpu is not None:
        raise UsageError("initialize(mpu=...): tp_model_init was given a tp_group; pass the groups one way, "
                         "the tp_group or the mpu, not both")
    section = cfg.tensor_parallel
    given = section.model_fields_set
    if "autotp_size" in given and section.autotp_size != args.tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size {section.autotp_size} in the config and "
                          f"tp_model_init(tp_size={args.tp_size}) disagree; give one size (or leave autotp_size out "
                          "of the config: tp_model_init fills it in)")
    tp_given = "tp_size" in section.tp.model_fields_set
    if tp_given and section.tp.tp_size != args.tp_size:
        raise ConfigError(f"tensor_parallel.tp.tp_size {section.tp.tp_size} in the config and "
                          f"tp_model_init(tp_size={args.tp_size}) disagree; give one size")
    group_size = _group_size(args.tp_group)
    if group_size is not None and group_size != args.tp_size:
        raise UsageError(f"tp_model_init(tp_size={args.tp_size}, tp_group=...): the group holds {group_size} ranks; "
                         "give a tp_group of tp_size ranks")
    config_dtype = _PRECISION_DTYPES.get(cfg.precision)
    if config_dtype is not None and config_dtype != args.dtype:
        raise ConfigError(f"tp_model_init(dtype={args.dtype}) but the config trains in {cfg.precision} "
                          f"({cfg.precision}.enabled); pass dtype={config_dtype} or change the config")
    if "dtype" in given and section.dtype is not None:
        named = _SECTION_DTYPES.get(section.dtype.lower()) if isinstance(section.dtype, str) else section.dtype
        if named is not None and named != args.dtype:
            raise ConfigError(f"tensor_parallel.dtype {section.dtype} in the config and "
                              f"tp_model_init(dtype={args.dtype}) disagree; give one dtype")
    update: dict[str, Any] = {}
    if "autotp_size" not in given:
        update["autotp_size"] = args.tp_size
    if not tp_given:
        update["tp"] = section.tp.model_copy(update={"tp_size": args.tp_size})
    if update:
        section = section.model_copy(update=update)
        refuse_unsupported(section, "config")  # checked at load for the config's own size
        cfg = cfg.model_copy(update={"tensor_parallel": section})
    return cfg, args.tp_group
