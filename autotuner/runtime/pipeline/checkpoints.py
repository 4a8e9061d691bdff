"""A pipeline engine's checkpoints: every stage's weights and optimizer state in one
torch.distributed.checkpoint directory (runtime/saving/checkpoint.py), each weight under its
PipelineModule name ("16.weight", "tied_modules.embed.weight"), so each stage saves and loads the
layers it holds; and `save_16bit_model`, the whole model in one file from rank 0.

DeepSpeed writes a pipeline's checkpoints as one file per layer (layer_XX-model_states.pt) and
cannot save a pipeline's whole model (its save_16bit_model fails there); these are our formats,
loaded back by this engine. A checkpoint loads into the same split: a stage whose layers the
checkpoint lacks is refused in one line (load_module_strict)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger("autotuner.runtime.pipeline")


class PipelineCheckpoints:
    """save_checkpoint, load_checkpoint and save_16bit_model for PipelineEngine."""

    def _holds(self, name: str) -> bool:
        """Whether a saved weight is this stage's: its layer index in this stage's range, or a tied
        layer this stage uses."""
        head = name.split(".", 1)[0]
        if head == "tied_modules":
            return name.split(".")[1] in self.module.tied_modules
        return head.isdigit() and self.module.holds_layer(int(head))

    def _keyed_by_the_model(self, optimizer: Any) -> contextlib.AbstractContextManager:
        """ZeRO 1 over split stages steps the shards' shadows: DCP sees the optimizer keyed by the
        model's parameters meanwhile (training/split_zero.py)."""
        shadows = getattr(self, "_shadows", None)
        return shadows.as_model_parameters(optimizer) if shadows is not None and optimizer is not None \
            else contextlib.nullcontext()

    def _param_group_members(self) -> list[list[str]]:
        names = {id(param): name for name, param in self.module.named_parameters()}
        shadows = getattr(self, "_shadows", None)
        for param, shadow in (shadows.pairs if shadows is not None else ()):  # ZeRO 1 over split stages
            names[id(shadow)] = names.get(id(param), "(a parameter outside the model)")
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [sorted(names.get(id(p), "(a parameter outside the model)") for p in group["params"]) for group in groups]

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Path:
        """Collective: every rank of every stage calls it."""
        from autotuner.runtime.saving import checkpoint

        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        members: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(members, (self.stage_id, self._param_group_members()))
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        state = {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "client_state": client_state or {},
            "param_groups": [checkpoint.plain_hyperparameters(group) for group in groups],
            "param_group_members_by_stage": {stage: names for stage, names in members},
            "zero_stage": self.config.zero_optimization.stage,
            "pipeline_parts": list(self.module.parts),
            "world_size": dist.get_world_size(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }
        frozen = ({name for name, param in self.module.named_parameters() if not param.requires_grad}
                  if exclude_frozen_parameters else set())
        with self._keyed_by_the_model(self._local_optimizer):
            return checkpoint.save(save_dir, tag, self.module, self._local_optimizer, state, save_latest=save_latest,
                                   exclude=frozen)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False,
                        custom_load_fn: Callable[..., Any] | None = None) -> tuple[str | None, dict | None]:
        """(path, client_state) as DeepSpeed returns them, or (None, None) without a checkpoint."""
        from autotuner.core.errors import ConfigError
        from autotuner.runtime.saving import checkpoint

        if custom_load_fn is not None:
            raise ConfigError("load_checkpoint(custom_load_fn=...): not supported for a pipeline (nor by DeepSpeed's "
                              "pipeline engine); load the weights without it")
        resolved = checkpoint.resolve_tag(load_dir, None if tag is None else str(tag))
        if resolved is None:
            logger.warning("%s: no 'latest' file and no tag given; nothing loaded", load_dir)
            return None, None
        path = Path(load_dir) / resolved
        optimizer = self._local_optimizer if load_optimizer_states and not load_module_only else None
        if optimizer is not None:
            saved = checkpoint.read_engine_state(path)
            by_stage = saved.get("param_group_members_by_stage", {})
            checkpoint.check_param_groups(path, {**saved, "param_group_members": by_stage.get(self.stage_id)},
                                          self._param_group_members())
        with self._keyed_by_the_model(optimizer):
            state = checkpoint.load(load_dir, resolved, self.module, optimizer, strict=load_module_strict,
                                    holds=self._holds)
        self.module._broadcast_tied_weights()  # each tied weight one weight again, as DeepSpeed does after a load
        if optimizer is not None:
            for group, saved_group in zip(self.optimizer.param_groups, state.get("param_groups", [])):
                group.update(saved_group)
        if load_module_only:
            return str(path), state.get("client_state", {})
        self.global_steps = state["global_steps"]
        self.global_samples = state["global_samples"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler"):  # fp16: the scale and its rule's state
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        return str(path), state.get("client_state", {})

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model, every stage's layers under their PipelineModule names, in one file written
        by rank 0 (fp32: a pipeline trains in fp32 here). Collective."""
        frozen = {name for name, param in self.module.named_parameters() if not param.requires_grad}
        coord = self.module.topology().get_coord(self.global_rank)
        mine: dict[str, torch.Tensor] = {}
        if coord.data == 0:  # one replica of each stage; a split stage's TP ranks gather its weights whole
            whole_stage = {name: _whole(tensor).detach().cpu() for name, tensor in self.module.state_dict().items()
                           if not (exclude_frozen_parameters and name in frozen)}
            mine = whole_stage if getattr(coord, "model", 0) == 0 else {}
        parts: list[Any] = [None] * dist.get_world_size() if self.global_rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.global_rank == 0:
            whole: dict[str, torch.Tensor] = {}
            for part in parts:
                whole.update(part)
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    torch.save(whole, handle)
                os.replace(partial, path)
            except BaseException:
                Path(partial).unlink(missing_ok=True)
                raise
        dist.barrier()
        return True


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A split weight gathered over its TP group (collective there); a whole one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
