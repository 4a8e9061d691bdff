"""The engine's optimizer step at a gradient-accumulation boundary (a mixin of runtime/engine.py's
Engine, whose state it reads): the loss scaler's unscale and verdict, the gradient norm and
clipping (AutoTP's over the split parameters), DeepSpeed's skip of a non-finite step, the
gradients dropped, the schedule advanced only on an applied step."""

from __future__ import annotations

import logging
from typing import Any

import torch

from autotuner.runtime.training.batch_ramp import scaled_schedule
from autotuner.runtime.training.loss_scale import skips_non_finite
from autotuner.runtime.training.optim import step_scheduler
from autotuner.runtime.training.sharding import finite_norm, gradient_norm, unwrap
from autotuner.runtime.training.tensor_parallel import tp_gradient_norm

logger = logging.getLogger("autotuner.runtime.engine")  # (the engine's own log, as before the split)


class OptimizerStep:
    """Engine's step at a boundary: `_optimizer_step`, `_drop_step`, `_gradient_norm`."""

    def _optimizer_step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        if self.optimizer.skip_step:
            # Set by the script after check_overflow (DeepSpeed-Chat's --align_overflow: the other
            # engine overflowed): this step's gradients are dropped, the loss scale stays.
            self.optimizer.skip_step = False
            self._drop_step()
            return
        if self._grad_scaler is not None:
            self._grad_scaler.unscale_(self.optimizer)
        self._global_grad_norm, non_finite = self._gradient_norm()
        self._step_applied = True
        if self._grad_scaler is not None:
            # Skipped when a gradient overflowed; the scale then follows DeepSpeed's rule (training/loss_scale.py).
            self._step_applied = self._grad_scaler.step(self.optimizer)
        elif self._skips_non_finite and non_finite:
            # DeepSpeed's ZeRO optimizers (and its bf16 optimizer at stage 0) skip a step whose
            # gradients hold an inf or NaN; only stage 0 in fp32 applies it.
            self._step_applied = False
            if self.ctx.rank == 0:
                logger.warning("step %d: the gradient norm is not finite; step skipped, as DeepSpeed skips it",
                               self.global_steps + 1)
        else:
            self.optimizer.step()
        self.optimizer.overflow = not self._step_applied  # DeepSpeed's optimizers' record of the last step
        if not self._step_applied:
            self._drop_step()
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self._shadows is not None:
            self._shadows.drop_gradients()
        if self.lr_scheduler is not None:  # DeepSpeed does not advance the schedule on a skipped step
            with scaled_schedule(self.optimizer, self._ramp.lr_factor if self._ramp is not None else 1.0):
                step_scheduler(self.lr_scheduler, lr_kwargs, self.batch.train_batch_size)

    def _drop_step(self) -> None:
        """A skipped step: gradients dropped, counted, the schedule not advanced."""
        self._step_applied = False
        self.optimizer.zero_grad(set_to_none=True)
        if self._shadows is not None:
            self._shadows.drop_gradients()
        self.skipped_steps += 1

    def _gradient_norm(self) -> tuple[torch.Tensor | None, bool]:
        """(The step's gradient norm, clipping with it; whether the gradients hold an inf or NaN). With
        compute_grad_norm false no norm is kept, as DeepSpeed keeps none, and the gradients are
        looked at only where a non-finite step is skipped (bf16's overflow check at ZeRO 1-2)."""
        if self._split is not None:
            named = list(unwrap(self.wrapped).named_parameters())
            clip = self.config.gradient_clipping if self.config.zero_optimization.compute_grad_norm else 0.0
            norm = tp_gradient_norm(named, self._split, self.layout, self._fsdp, clip)
            return (norm if self.config.zero_optimization.compute_grad_norm else None), not finite_norm(norm)
        parameters = list(self.wrapped.parameters())
        if self.config.zero_optimization.compute_grad_norm:
            norm = gradient_norm(parameters, self.config.gradient_clipping)
            return norm, not finite_norm(norm)
        return None, self._skips_non_finite and not finite_norm(gradient_norm(parameters, 0.0))

    @property
    def _skips_non_finite(self) -> bool:
        return skips_non_finite(self.config, self.precision)
