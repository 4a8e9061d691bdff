"""The DeepSpeed engine's read-only members that training scripts call, for our Engine.

Names and return values follow DeepSpeed's engine, so a script that logs or branches on them
runs unchanged. The Engine sets the attributes these read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


class DeepSpeedAccessors:
    # Set by Engine.__init__ and its step.
    wrapped: nn.Module
    ctx: Any
    layout: Any
    batch: Any
    config: Any
    optimizer: torch.optim.Optimizer
    zero_stage: int
    precision: str
    micro_steps: int
    _boundary_base: int
    skipped_steps: int
    _grad_scaler: Any
    _global_grad_norm: torch.Tensor | None
    _step_applied: bool
    _boundary_override: bool | None
    _client_optimizer: bool
    reporter: Any

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's pass-through: a name the engine lacks is looked up on the user's model
        (`engine.generate`, `engine.gradient_checkpointing_enable()`); the engine's own names come
        first, nn.Module's parameters, buffers and submodules included. A model method found there
        runs as the engine's forward would (training/method_calls.py)."""
        try:
            return super().__getattr__(name)  # nn.Module's: what it registered
        except AttributeError:
            pass
        wrapped = self.__dict__.get("_modules", {}).get("wrapped")
        if wrapped is not None:
            inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
            try:
                value = getattr(inner, name)
            except AttributeError:
                pass
            else:
                return self._through_engine(name, value)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @property
    def module(self) -> nn.Module:
        """The user's model, as in DeepSpeed: not the DDP wrapper (FSDP2 shards it in place)."""
        return self.wrapped.module if isinstance(self.wrapped, DistributedDataParallel) else self.wrapped

    @property
    def global_rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def dp_world_size(self) -> int:
        return self.layout.dp_size  # world / tensor_parallel.autotp_size

    @property
    def mp_world_size(self) -> int:
        return self.layout.tp_size

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.layout.tp_rank

    def get_model_parallel_rank(self) -> int:
        return self.layout.tp_rank  # tensor parallelism is the only model parallelism here, as in DeepSpeed's AutoTP

    def autotp_size(self) -> int:
        """DeepSpeed's engine.autotp_size(): the config's value (0 or 1: no tensor parallelism)."""
        return self.config.tensor_parallel.autotp_size

    def tensor_parallel_config(self) -> Any:
        return self.config.tensor_parallel

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return self._micro_in_step() + 1 == self.batch.gradient_accumulation_steps

    def _micro_in_step(self) -> int:
        """Micro-steps of this optimizer step so far (counted from the last change of the batch)."""
        return (self.micro_steps - self._boundary_base) % self.batch.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch changed through gradient accumulation, the micro-batch kept
        (ValueError, DeepSpeed's, where it does not divide micro-batch x data-parallel size). Called
        between optimizer steps; unlike DeepSpeed's, whose boundary stays micro_steps modulo the new
        count (so the next step can run short), the next step runs the whole new count."""
        micro, dp = self.batch.micro_batch_size, self.batch.data_parallel_size
        if train_batch_size % (micro * dp) != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism")
        from autotuner.config.batch import BatchSizes

        self.batch = BatchSizes(train_batch_size, micro, train_batch_size // (micro * dp), dp)
        self._boundary_base = self.micro_steps

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: the micro-batch changed, the accumulation count kept (the global batch follows).
        The engine's own loader is not resized here, as DeepSpeed's is not (the batch ramp does that)."""
        from autotuner.config.batch import BatchSizes, train_batch_size

        gas, dp = self.batch.gradient_accumulation_steps, self.batch.data_parallel_size
        self.batch = BatchSizes(train_batch_size(micro_batch_size, gas, dp), micro_batch_size, gas, dp)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's manual override of the accumulation boundary: it holds until set again
        (None goes back to counting micro-steps)."""
        self._boundary_override = is_boundary

    def train_batch(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _no_pipeline_engine()

    def eval_batch(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _no_pipeline_engine()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        """Adam's betas, or SGD's momentum, per param group (DeepSpeed's get_mom)."""
        if self.optimizer is None:
            return []
        return [group.get("betas", group.get("momentum")) for group in self.optimizer.param_groups]

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def amp_enabled(self) -> bool:
        return False  # DeepSpeed's "amp" (NVIDIA apex) section is not supported

    def zero_optimization(self) -> bool:
        return self.zero_stage > 0

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def loss_scale(self) -> float:
        """The config's static fp16.loss_scale, 0 meaning dynamic, as DeepSpeed's loss_scale() returns."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def optimizer_name(self) -> str | None:
        if self.optimizer is None:
            return None  # DeepSpeed's, for an engine built without one
        return self.config.optimizer.type if self.config.optimizer is not None and not self._client_optimizer \
            else type(self.optimizer).__name__

    @property
    def monitor(self) -> Any:
        """DeepSpeed's MonitorMaster: write_events([(name, value, step), ...]) on rank 0."""
        return self.reporter.monitor

    @property
    def tput_timer(self) -> Any:
        """DeepSpeed's ThroughputTimer: avg_samples_per_sec() after the two warm-up steps."""
        return self.reporter.tput_timer

    def get_wall_clock_timers(self) -> dict[str, float]:
        """The last step's timers in ms (wall_clock_breakdown only), as DeepSpeed's engine keeps them."""
        clock = self.reporter.wall_clock
        return dict(clock.cache) if clock is not None else {}

    def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's weights in the training precision, one file written by rank 0; collective."""
        from autotuner.runtime.saving.model_save import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Release what the engine holds beyond the model: monitors (wandb's run, open event files).
        The engine stays usable for reading, as DeepSpeed's does."""
        self.reporter.close()

    def save_fp16_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)  # DeepSpeed's older name

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile()`: compile the model's repeated blocks in place (the model
        whole if it has none), as the `compile` section does before wrapping. DeepCompile's
        `schedule` and compiled autograd are DeepSpeed's own and refused."""
        from autotuner.core.errors import UnsupportedError
        from autotuner.runtime.training.compiling import compile_blocks, is_compiled

        if schedule is not None or compiled_autograd_enabled:
            raise UnsupportedError("engine.compile(schedule=..., compiled_autograd_enabled=True): DeepCompile's "
                                   "passes and compiled autograd are DeepSpeed's engine's own; call "
                                   "engine.compile(backend=..., compile_kwargs=...) without them")
        if not is_compiled(self.module):  # the config's compile section may have compiled it already
            compile_blocks(self.module, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        from autotuner.runtime.training.compiling import is_compiled

        return is_compiled(self.module)

    def get_global_grad_norm(self) -> float | None:
        """Norm of all gradients at the last optimizer step, before clipping; None before the first."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def was_step_applied(self) -> bool:
        """True right after a micro-step that stepped the optimizer: False between accumulation
        boundaries and when fp16 overflow skipped the step (DeepSpeed's semantics)."""
        return self._step_applied


def _no_pipeline_engine() -> Exception:
    # The engine's own refusal (the DeepSpeed import paths' refusals are autotuner/deepspeed_paths/unsupported.py).
    from autotuner.core.errors import UnsupportedError

    return UnsupportedError("deepspeed.train_batch is not supported by autotuner: engine.train_batch/eval_batch drive "
                            "a pipeline engine, which is not supported; call engine(batch), engine.backward(loss) and "
                            "engine.step() in your own loop")
