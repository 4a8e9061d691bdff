"""fp16 loss scaling as DeepSpeed's engine does it, on torch's GradScaler.

torch's scaler (ShardedGradScaler under FSDP2 or tensor parallelism, unscaling DTensors' local
tensors) scales the loss, unscales the gradients, finds
inf/NaN among them and skips the optimizer step. What the scale does next is DeepSpeed's rule,
set through `update(new_scale=...)`, since torch's own halves on every overflow and has no floor:
- `fp16.loss_scale` > 0: a static scale. An overflowing step is skipped; the scale stays.
- 0 (dynamic): starts at 2**initial_scale_power. An overflow first uses up the `hysteresis`
  (the scale stays), then halves the scale, never below `min_loss_scale`; `loss_scale_window`
  steps in a row without one double it and refill the hysteresis (`consecutive_hysteresis`:
  any step without an overflow refills it).
One departure: at the floor DeepSpeed's engine stops the run ("Current loss scale already at
minimum"); here the step is skipped and the scale stays at the floor, so training goes on.

Outside fp16, `skips_non_finite` says which steps whose gradients hold an inf or NaN are skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from autotuner.config.models import DeepSpeedConfig, FP16Config


def skips_non_finite(config: DeepSpeedConfig, precision: str) -> bool:
    """Whether a step whose gradients hold an inf or NaN is skipped, as DeepSpeed 0.19.8 decides:
    ZeRO 1-2 on their overflow check (bf16, unless bf16.check_grad_overflow is false) or on the
    norm (fp32, unless zero_optimization.compute_grad_norm is false); ZeRO 3, and its bf16 optimizer
    at stage 0, always; stage 0 in fp32 never. fp16 overflow is the grad scaler's, before this."""
    stage = config.zero_optimization.stage
    if stage in (1, 2):
        if precision == "bf16":
            return config.bf16.check_grad_overflow
        return config.zero_optimization.compute_grad_norm
    return stage == 3 or precision == "bf16"

_NEVER = 2**31 - 1  # torch's growth interval: never, the policy below grows the scale


@dataclass
class DynamicScale:
    """DeepSpeed's dynamic rule: the state it keeps between steps."""

    scale_window: int
    min_scale: float
    hysteresis: int
    consecutive_hysteresis: bool
    hysteresis_left: int
    step: int = 0
    last_overflow_step: int = -1

    def next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                scale = max(scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_step = self.step
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.step - self.last_overflow_step - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                scale *= 2
        self.step += 1
        return scale


def _local_grad_scaler() -> type:
    """torch's ShardedGradScaler (found_inf all-reduced over the world, so every rank skips the same
    step), unscaling each DTensor gradient's local tensor: under tensor parallelism at ZeRO 0 a
    rank's gradients are split DTensors beside whole tensors, which one foreach call cannot take."""
    from collections import defaultdict

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class LocalGradScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            grads = defaultdict(list)  # by (device, dtype), as torch groups them for its foreach kernel
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is None:
                            continue
                        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                        grads[(local.device, local.dtype)].append(local)
                found = {}
                for (device, _), tensors in grads.items():
                    found.setdefault(device, found_inf.to(device))
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv_scale.to(device))
            return found or {found_inf.device: found_inf}

    return LocalGradScaler


class LossScaler:
    """torch's scaler for the mechanics, DeepSpeed's rule for the scale (module docstring)."""

    def __init__(self, config: FP16Config, device: torch.device, sharded: bool):
        self._static = config.loss_scale if config.loss_scale > 0 else None
        initial = self._static or 2.0**config.initial_scale_power
        if sharded:
            self._torch = _local_grad_scaler()(device.type, init_scale=initial, growth_interval=_NEVER)
        else:
            self._torch = torch.amp.GradScaler(device.type, init_scale=initial, growth_interval=_NEVER)
        self._dynamic = None if self._static else DynamicScale(
            config.loss_scale_window, config.min_loss_scale, config.hysteresis, config.consecutive_hysteresis,
            hysteresis_left=config.hysteresis)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._torch.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._torch.unscale_(optimizer)

    def get_scale(self) -> float:
        return float(self._torch.get_scale())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer's step unless a gradient overflowed; the next scale set. Whether it stepped."""
        before = self.get_scale()
        self._torch.step(optimizer)
        self._torch.update()  # lowers the scale exactly when the step was skipped (growth is off)
        overflow = self.get_scale() < before
        following = self._static if self._static else self._dynamic.next_scale(before, overflow)
        self._torch.update(new_scale=float(following))
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        return {"torch": self._torch.state_dict(), "dynamic": asdict(self._dynamic) if self._dynamic else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        old_format = "torch" not in state  # written before the rule: torch's scaler state alone
        self._torch.load_state_dict(state if old_format else state["torch"])
        self._torch.set_growth_interval(_NEVER)  # an old checkpoint's interval would let torch grow it too
        if self._dynamic is not None and not old_format and state.get("dynamic"):
            self._dynamic = DynamicScale(**state["dynamic"])
