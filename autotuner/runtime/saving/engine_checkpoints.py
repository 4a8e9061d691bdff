"""The engine's checkpoints, as DeepSpeed's engine saves and loads them (save_checkpoint,
load_checkpoint), over torch.distributed.checkpoint (runtime/saving/checkpoint.py). A mixin of Engine:
it reads the engine's step counts, optimizer, schedule and loss scale."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

logger = logging.getLogger("autotuner.runtime.engine")  # its lines keep the engine's name


class EngineCheckpoints:
    """save_checkpoint and load_checkpoint for Engine (the state they keep is listed in save_checkpoint)."""

    def _checkpoint_model(self) -> nn.Module:
        return self.module

    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Path:
        """Save with torch.distributed.checkpoint; ZeRO-2/3 checkpoints are sharded. Collective.
        `save_latest`: point the `latest` file at this tag; `exclude_frozen_parameters`: leave out
        the weights of parameters that do not train (such a checkpoint loads with
        load_module_strict=False, as in DeepSpeed)."""
        from autotuner.runtime.saving import checkpoint  # DCP imports DTensor: ~1 s, paid only when used

        tag = f"global_step{self.global_steps}" if tag is None else str(tag)  # DeepSpeed's str(tag): a loss as a tag
        state = {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "grad_scaler": self._grad_scaler.state_dict() if self._grad_scaler is not None else None,
            "client_state": client_state or {},
            "param_groups": [checkpoint.plain_hyperparameters(group) for group in self._optimizer_groups()],
            "param_group_members": self._param_group_members(),
            "zero_stage": self.zero_stage,
            "world_size": self.ctx.world_size,
        }
        ramp = getattr(self, "_ramp", None)
        if ramp is not None:  # the batch ramp's state, and the global batch it reached
            state["batch_ramp"] = {**ramp.state(), "train_batch_size": self.batch.train_batch_size,
                                   "micro_batch_size": self.batch.micro_batch_size}
        frozen = ({name for name, param in self._checkpoint_model().named_parameters() if not param.requires_grad}
                  if exclude_frozen_parameters else set())
        with self._keyed_by_the_model(self._local_optimizer):
            return checkpoint.save(save_dir, tag, self._checkpoint_model(), self._local_optimizer, state,
                                   save_latest=save_latest, exclude=frozen)

    def _keyed_by_the_model(self, optimizer) -> contextlib.AbstractContextManager:
        """ZeRO 1 under tensor parallelism steps shadows of the split parameters: DCP sees the
        optimizer keyed by the model's parameters meanwhile (training/split_zero.py)."""
        shadows = getattr(self, "_shadows", None)
        return shadows.as_model_parameters(optimizer) if shadows is not None and optimizer is not None \
            else contextlib.nullcontext()

    def _resume_batch_ramp(self, saved: dict | None) -> None:
        """A checkpoint saved mid-ramp resumes at the global batch, learning-rate factor and noise
        estimate it reached (the rate itself comes back with the optimizer's groups)."""
        ramp = getattr(self, "_ramp", None)
        if saved is None:
            return
        if ramp is None:
            if saved["train_batch_size"] != self.batch.train_batch_size:
                logger.warning("the checkpoint's batch ramp had reached global batch %d; without "
                               "autotuning.adapt_batch this run trains at %d", saved["train_batch_size"],
                               self.batch.train_batch_size)
            return
        from autotuner.runtime.training.batch_ramp import follow_batch, resize

        ramp.load(saved)
        resize(self, int(saved.get("micro_batch_size", self.batch.micro_batch_size)), int(saved["train_batch_size"]))
        follow_batch(self._noise, self.batch)

    def _param_group_members(self) -> list[list[str]]:
        """Each optimizer group's parameters by name, so a load can tell the groups were split alike."""
        names = {id(param): name for name, param in self._checkpoint_model().named_parameters()}
        shadows = getattr(self, "_shadows", None)
        for param, shadow in shadows.pairs if shadows is not None else ():
            names[id(shadow)] = names.get(id(param), "(a parameter outside the model)")
        return [sorted(names.get(id(param), "(a parameter outside the model)") for param in group["params"])
                for group in self._optimizer_groups()]

    def _optimizer_groups(self) -> list[dict]:
        """The optimizer's groups; none for an engine built without an optimizer (forward only)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False,
                        custom_load_fn: Callable[..., Any] | None = None) -> tuple[str | None, dict | None]:
        """Returns (path, client_state) like DeepSpeed, or (None, None) when there is no checkpoint.
        As in DeepSpeed: `load_module_only` loads the weights alone (no optimizer, schedule or step
        counts); `custom_load_fn(src=state_dict, dst=module)` loads the weights in place of
        load_state_dict, given every weight the checkpoint holds and with `load_module_strict` not
        applied. Under FSDP2 the model's weights come as this rank's DTensor shards, and weights
        the model has no tensor for as whole tensors on the CPU."""
        from autotuner.runtime.saving import checkpoint

        resolved = checkpoint.resolve_tag(load_dir, None if tag is None else str(tag))
        if resolved is None:
            logger.warning("%s: no 'latest' file and no tag given; nothing loaded", load_dir)
            return None, None
        optimizer = self._local_optimizer if load_optimizer_states and not load_module_only else None
        with self._keyed_by_the_model(optimizer):
            state = checkpoint.load(load_dir, resolved, self._checkpoint_model(), optimizer, strict=load_module_strict,
                                    custom_load_fn=custom_load_fn, param_group_members=self._param_group_members())
        if optimizer is not None:
            # ZeRO-1 copies its global groups' hyperparameters into the local optimizer at each
            # step, so they are restored from the engine state, not from the local optimizer.
            for group, saved in zip(self._optimizer_groups(), state.get("param_groups", [])):
                group.update(saved)
        if load_module_only:
            return str(Path(load_dir) / resolved), state.get("client_state", {})
        self.global_steps = state["global_steps"]
        # micro_steps is not restored, as in DeepSpeed: the gradients of a half-accumulated step are
        # not in the checkpoint, and a resumed run may accumulate over another count.
        self._boundary_base = self.micro_steps  # the next micro-step starts an optimizer step
        self.global_samples = state["global_samples"]
        self.skipped_steps = state.get("skipped_steps", self.skipped_steps)
        self._resume_batch_ramp(state.get("batch_ramp"))
        self.step_gate.leave_step(self.global_steps)
        if load_lr_scheduler_states and self.lr_scheduler is not None and state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self._grad_scaler is not None and optimizer is not None and state.get("grad_scaler"):
            # DeepSpeed keeps the loss scale with the optimizer's state: without it, a fresh scale.
            self._grad_scaler.load_state_dict(state["grad_scaler"])
        return str(Path(load_dir) / resolved), state.get("client_state", {})
