"""The batch ramp (autotuning.adapt_batch) on DeepSpeed's own engine.

A script that trains on DeepSpeed's engine reads the optimal config itself, and DeepSpeed ignores
the `autotuning` keys it does not know. So each rank our launcher starts (launch/run_script.py)
looks at every DeepSpeedEngine as it is built: where its config asks for the ramp, the engine
gets the same ramp ours has (training/batch_ramp.py), through DeepSpeed's own calls:

- the gradient noise is read around its boundary all-reduce (measure/gradient_noise.py
  `DeepSpeedNoiseProbe`: ZeRO 0, fp32 or bf16, data parallel only; elsewhere one warning says the
  batch stays);
- after each optimizer step, rank 0's choice is applied with `engine.set_train_batch_size`, which
  changes gradient accumulation only. DeepSpeed counts its boundary as `(micro_steps + 1) % gas`,
  and micro_steps is a counter for that alone (not checkpointed: a resumed engine starts at 0), so
  it is moved up to the next multiple of the new count: the next step runs the whole count, as on
  our engine, where DeepSpeed's modulo would cut it short;
- the learning-rate factor is kept over DeepSpeed's scheduler as over ours (`scaled_schedule`
  around its `lr_scheduler.step`);
- `save_checkpoint` adds the ramp's state to the client state, and `load_checkpoint` takes it back
  (the global batch, the factor, the estimator), so a resume goes on at the ramp's batch.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

from autotuner.runtime.measure.gradient_noise import DeepSpeedNoiseProbe
from autotuner.runtime.training.batch_ramp import BatchRamp, RampPlan, follow_batch, ramp_after_step, scaled_schedule

CLIENT_STATE_KEY = "autotuner_batch_ramp"


@dataclass(frozen=True)
class RampBatch:
    """The engine's batch as the ramp reads it (our engine's `batch` record has these fields)."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    train_batch_size: int


class DeepSpeedRampTarget:
    """What `ramp_after_step` reads and calls, over a DeepSpeedEngine."""

    def __init__(self, engine: Any, ramp: BatchRamp, noise: DeepSpeedNoiseProbe):
        self.engine = engine
        self._ramp = ramp
        self._noise = noise

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    @property
    def batch(self) -> RampBatch:
        engine = self.engine
        return RampBatch(int(engine.train_micro_batch_size_per_gpu()), int(engine.gradient_accumulation_steps()),
                         int(engine.dp_world_size), int(engine.train_batch_size()))

    @property
    def _boundary_override(self) -> bool | None:
        """Set where the script drives DeepSpeed's boundary (accelerate does, by
        set_gradient_accumulation_boundary, or managed_gradient_accumulation is off)."""
        engine = self.engine
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        return engine._is_gradient_accumulation_boundary if managed else True

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.engine.optimizer.param_groups]

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's call, at an accumulation boundary; then its boundary counter realigned."""
        engine = self.engine
        engine.set_train_batch_size(train_batch_size)
        gas = int(engine.gradient_accumulation_steps())
        engine.micro_steps = -(-int(engine.micro_steps) // gas) * gas


def install() -> None:
    """Give every DeepSpeedEngine this process builds the ramp its config asks for."""
    from autotuner.runtime.deepspeed_side import when_deepspeed_loads

    when_deepspeed_loads(lambda: _patch(sys.modules["deepspeed.runtime.engine"].DeepSpeedEngine))


def _patch(engine_class: type) -> None:
    if getattr(engine_class, "_autotuner_ramp_patched", False):
        return
    init = engine_class.__init__

    @functools.wraps(init)
    def init_with_ramp(engine, *args, **kwargs):
        init(engine, *args, **kwargs)
        plan = _plan_asked(engine)
        if plan is not None:
            attach(engine, plan)

    engine_class.__init__ = init_with_ramp
    engine_class._autotuner_ramp_patched = True


def _plan_asked(engine: Any) -> str | None:
    """The plan's path where the engine's config turns the ramp on (the tuner's optimal config)."""
    tuning = (getattr(engine._config, "_param_dict", None) or {}).get("autotuning") or {}
    if not (isinstance(tuning, dict) and tuning.get("adapt_batch") and tuning.get("adapt_plan")):
        return None
    return str(tuning["adapt_plan"])


def attach(engine: Any, plan_path: str) -> DeepSpeedRampTarget | None:
    """The ramp on this engine, or None (one warning) where the noise cannot be read."""
    import torch.distributed as dist

    from autotuner.runtime.distributed import warn_once

    why = DeepSpeedNoiseProbe.unusable(engine)
    if why is not None:
        warn_once(f"autotuning.adapt_batch: the gradient noise is not read with {why}; the global batch stays "
                  "as the optimal config sets it")
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    target = DeepSpeedRampTarget(engine, BatchRamp(RampPlan.read(plan_path), rank), DeepSpeedNoiseProbe(engine))
    _wrap_step(engine, target)
    _wrap_scheduler(engine, target)
    _wrap_checkpoints(engine, target)
    engine.__dict__["_autotuner_batch_ramp"] = target
    return target


def _wrap_step(engine: Any, target: DeepSpeedRampTarget) -> None:
    step = engine.step

    @functools.wraps(step)
    def step_then_ramp(*args, **kwargs):
        before = engine.global_steps
        result = step(*args, **kwargs)
        if engine.global_steps != before:  # an optimizer step (a skipped fp16 step does not count either)
            ramp_after_step(target)
        return result

    engine.__dict__["step"] = step_then_ramp


def _wrap_scheduler(engine: Any, target: DeepSpeedRampTarget) -> None:
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None:
        return  # no schedule: the factor stays in the optimizer's rates
    scheduler_step = scheduler.step

    @functools.wraps(scheduler_step)
    def step_under_factor(*args, **kwargs):
        with scaled_schedule(engine.optimizer, target._ramp.lr_factor):
            return scheduler_step(*args, **kwargs)

    scheduler.step = step_under_factor


def _wrap_checkpoints(engine: Any, target: DeepSpeedRampTarget) -> None:
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_with_ramp(save_dir, tag=None, client_state=None, *args, **kwargs):
        state = {**(client_state or {}), CLIENT_STATE_KEY: {"ramp": target._ramp.state(),
                                                            "train_batch_size": int(engine.train_batch_size())}}
        return save(save_dir, tag, state, *args, **kwargs)

    @functools.wraps(load)
    def load_with_ramp(*args, **kwargs):
        path, client_state = load(*args, **kwargs)
        saved = client_state.pop(CLIENT_STATE_KEY, None) if isinstance(client_state, dict) else None
        if saved is not None:
            target._ramp.load(saved["ramp"])
            target.set_train_batch_size(int(saved["train_batch_size"]))
            follow_batch(target._noise, target.batch)
        return path, client_state

    engine.__dict__["save_checkpoint"] = save_with_ramp
    engine.__dict__["load_checkpoint"] = load_with_ramp
