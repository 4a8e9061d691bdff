"""Checkpoints through torch.distributed.checkpoint (DCP).

Each rank writes only what it holds: FSDP2 shards (ZeRO-2/3), its ZeRO-1 optimizer
partition, and rank-identical DDP state once. The engine's own state (step counts, the LR
schedule's and the client's state) goes through torch.save and is read back weights-only: a
schedule's Counter of milestones or a client's int keys and tuples come back as they were (JSON
turned them into strings and lists), and nothing here unpickles arbitrary objects.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from autotuner.core.errors import AutotunerError

LATEST_FILE = "latest"
# Keys per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), not per group index:
# ZeRO-1 ranks hold different groups, and index keys would collide when DCP merges ranks.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
ENGINE_STATE_FILE = "engine_state.pt"
JSON_ENGINE_STATE_FILE = "engine_state.json"  # checkpoints written before engine_state.pt: still read


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with weights_only=False; we refuse that.
    It loads what the checkpoint has: the caller has checked that only optimizer states of
    parameters that never had a gradient are missing."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=True)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _ensure_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP loads into existing tensors, so an optimizer that never stepped needs its state made first."""
    if optimizer.state:
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state  # noqa: PLC0415

    _init_optim_state(optimizer)


def save(
    save_dir: str | Path,
    tag: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    engine_state: dict[str, Any],
    *,
    save_latest: bool = True,
    exclude: set[str] = frozenset(),
) -> Path:
    """Save model and optimizer with DCP under save_dir/tag; rank 0 writes engine state and, with
    `save_latest`, `latest`. Model weights named in `exclude` are left out."""
    path = Path(save_dir) / tag
    engine_bytes = engine_state_bytes(engine_state)  # on every rank, before any collective: all refuse alike
    state = {"model": {name: value for name, value in get_model_state_dict(model).items() if name not in exclude}}
    if optimizer is not None:  # (an engine built without one saves its weights alone)
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), overwrite=True))
    if dist.get_rank() == 0:
        tmp = path / f".{ENGINE_STATE_FILE}.tmp"
        tmp.write_bytes(engine_bytes)
        tmp.replace(path / ENGINE_STATE_FILE)
        if save_latest:
            tmp = Path(save_dir) / f".{LATEST_FILE}.tmp"
            tmp.write_text(tag)
            tmp.replace(Path(save_dir) / LATEST_FILE)
    dist.barrier()
    return path


def engine_state_bytes(engine_state: dict[str, Any]) -> bytes:
    """The engine state as torch.save writes it, checked to load back weights-only."""
    buffer = io.BytesIO()
    torch.save(engine_state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the unpickler refuses, said in one line
        raise AutotunerError(f"save_checkpoint: client_state or the LR scheduler's state holds something a "
                             f"weights-only load cannot read back ({str(err).splitlines()[0][:200]}); keep it to "
                             "tensors, numbers, strings, lists, tuples, dicts and Counters") from None
    return buffer.getvalue()


def read_engine_state(path: Path) -> dict[str, Any]:
    if (path / ENGINE_STATE_FILE).exists():
        return torch.load(path / ENGINE_STATE_FILE, weights_only=True)
    return json.loads((path / JSON_ENGINE_STATE_FILE).read_text())


def resolve_tag(load_dir: str | Path, tag: str | None) -> str | None:
    if tag is not None:
        return tag
    latest = Path(load_dir) / LATEST_FILE
    return latest.read_text().strip() if latest.exists() else None


def load(
    load_dir: str | Path, tag: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
    *, strict: bool = True, custom_load_fn: Callable[..., Any] | None = None,
    param_group_members: list[list[str]] | None = None, holds: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Load into model (and optimizer) in place; returns the saved engine state. With `strict`,
    the checkpoint's weights and the model's must name the same tensors (load_state_dict's rule);
    without it, weights the checkpoint lacks keep their values and extra ones are ignored.
    `param_group_members`: the optimizer's groups as parameter names, checked against the saved
    ones before anything is loaded (see check_param_groups). `holds`: which saved weights are this
    rank's to hold, where a rank holds part of the model (a pipeline stage): strictness compares
    those alone."""
    path = Path(load_dir) / tag
    if not (path / ENGINE_STATE_FILE).exists() and not (path / JSON_ENGINE_STATE_FILE).exists():
        raise AutotunerError(f"{path}: not a checkpoint written by save_checkpoint ({ENGINE_STATE_FILE} missing)")
    if optimizer is not None and param_group_members is not None:
        check_param_groups(path, read_engine_state(path), param_group_members)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        _ensure_optimizer_state(model, optimizer)
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = set(metadata)
    if custom_load_fn is None:  # DeepSpeed applies load_module_strict only to its own load
        _check_module_keys(path, set(state["model"]), saved, strict, holds)
    state["model"] = {name: value for name, value in state["model"].items() if f"model.{name}" in saved}
    if custom_load_fn is not None:
        state["model"].update(_weights_the_model_lacks(metadata, state["model"]))
    stateless = _parameters_saved_without_state(path, state, saved)
    dcp.load(state, checkpoint_id=str(path), planner=_WeightsOnlyLoadPlanner())
    if custom_load_fn is not None:
        custom_load_fn(src=state["model"], dst=model)
    else:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
        # Parameters that never had a gradient had no optimizer state when saved (Adam makes it at
        # their first step); the template made one for them, which must not survive the load.
        by_name = dict(model.named_parameters())
        for name in stateless:
            param = by_name.get(name)
            if param is not None:
                optimizer.state.pop(param, None)
    return read_engine_state(path)


def _weights_the_model_lacks(metadata: dict[str, Any], model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Templates for the checkpoint's weights this model has no tensor for (a renamed layer, say):
    a custom_load_fn gets every weight saved, as DeepSpeed's gets the checkpoint's own state dict.
    Whole tensors on the CPU, since no parameter says how to shard them."""
    lacking = {}
    for key, item in metadata.items():
        name = key[len("model."):]
        if key.startswith("model.") and name not in model_state and isinstance(item, TensorStorageMetadata):
            lacking[name] = torch.empty(item.size, dtype=item.properties.dtype)
    return lacking


def check_param_groups(path: Path, engine_state: dict[str, Any], members: list[list[str]]) -> None:
    """The optimizer's parameter groups must be the saved ones: the saved hyperparameters are put
    back group by group, so another split (weight decay's groups changed, say) would give each
    group another's learning rate and decay. As torch's Optimizer.load_state_dict, refused.
    Checkpoints older than the saved membership are checked on the group count alone."""
    saved_groups = engine_state.get("param_groups", [])
    advice = "pass load_optimizer_states=False to load the weights alone"
    if len(saved_groups) != len(members):
        raise AutotunerError(f"{path}: the checkpoint's optimizer has {len(saved_groups)} parameter group(s) and this "
                             f"one {len(members)}; {advice}")
    saved_members = engine_state.get("param_group_members")
    if saved_members is None:
        return
    for index, (saved, now) in enumerate(zip(saved_members, members)):
        if sorted(saved) != sorted(now):
            moved = sorted(set(saved) ^ set(now))
            raise AutotunerError(f"{path}: parameter group {index} holds other parameters than when saved "
                                 f"({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}); {advice}")


def _check_module_keys(path: Path, model_keys: set[str], saved: set[str], strict: bool,
                       holds: Callable[[str], bool] | None = None) -> None:
    """load_module_strict: the checkpoint's weights are exactly the model's (those it holds)."""
    if not strict:
        return
    saved_model = {key[len("model."):] for key in saved if key.startswith("model.")}
    if holds is not None:
        saved_model = {key for key in saved_model if holds(key)}
    missing, unexpected = sorted(model_keys - saved_model), sorted(saved_model - model_keys)
    if missing or unexpected:
        what = (f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else
                f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}")
        raise AutotunerError(f"{path}: the checkpoint's weights do not match this model ({what}); pass "
                             "load_module_strict=False to load what matches (as for a checkpoint saved with "
                             "exclude_frozen_parameters=True)")


def _parameters_saved_without_state(path: Path, state: dict[str, Any], saved: set[str]) -> set[str]:
    """Names of parameters whose optimizer state the checkpoint lacks. Any other missing key (a
    hyperparameter) means the checkpoint does not fit this optimizer: refused."""
    wanted = {f"{section}.{key}" for section, part in state.items() for key in part}
    missing = wanted - saved
    stateless, other = set(), []
    prefix = "optim.state."
    for key in sorted(missing):
        if key.startswith(prefix):
            stateless.add(key[len(prefix):].rsplit(".", 1)[0])
        else:
            other.append(key)
    # A parameter with some of its state saved had a gradient: what is missing is a state this
    # optimizer keeps and the saved one did not (amsgrad switched on), not a fresh start. Refused.
    other += sorted(key for key in missing if key.startswith(prefix)
                    and any(s.startswith(prefix + key[len(prefix):].rsplit(".", 1)[0] + ".") for s in saved))
    if other:
        raise AutotunerError(f"{path}: the checkpoint does not match this model and optimizer; missing "
                             f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''}")
    return stateless


def plain_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's JSON-safe hyperparameters (lr, betas, ...), without the parameters."""
    plain = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, (int, float, bool, str, type(None))):
            plain[key] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
            plain[key] = list(value) if isinstance(value, list) else value
    return plain
