"""`deepspeed.checkpointing` (Megatron-style activation checkpointing) on torch.utils.checkpoint.

`checkpoint(function, *args)` recomputes `function`'s activations in the backward pass, with the
random state of the forward restored (dropout masks match), as DeepSpeed's does. `configure` takes
DeepSpeed's arguments; the ones that need model parallelism or its kernels (partitioned or
contiguous activations, CPU checkpointing) are refused when set, the rest are accepted. The
model-parallel RNG tracker keeps named generator states; with every rank data parallel here, its
model-parallel seed is the seed given.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from autotuner.core.errors import UnsupportedError

_configured = False
_num_checkpoints: int | None = None
_MODEL_PARALLEL_RNG = "model-parallel-rng"


def _refuse_set(name: str, value: Any) -> None:
    if value:
        raise UnsupportedError(f"deepspeed.checkpointing.configure({name}=True) is not supported by autotuner: it "
                               "needs model parallelism or DeepSpeed's kernels; every rank is data parallel here, "
                               "so leave it unset")


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's configure: its keys may also come from the config's activation_checkpointing section."""
    global _configured, _num_checkpoints
    section: dict[str, Any] = {}
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("activation_checkpointing", {}) or {}
    elif isinstance(deepspeed_config, str):
        from autotuner.config.loader import read_config_file

        section = read_config_file(deepspeed_config).get("activation_checkpointing", {}) or {}
    pick = lambda given, key: given if given is not None else section.get(key)  # noqa: E731
    _refuse_set("partition_activations", pick(partition_activations, "partition_activations"))
    _refuse_set("contiguous_checkpointing", pick(contiguous_checkpointing, "contiguous_memory_optimization"))
    _refuse_set("checkpoint_in_cpu", pick(checkpoint_in_cpu, "cpu_checkpointing"))
    _num_checkpoints = pick(num_checkpoints, "number_checkpoints")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed resets its per-iteration buffers here; torch keeps none between iterations."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run `function(*args)` without keeping its activations; recompute them for backward."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)


class CudaRNGStatesTracker:
    """Named random states (Megatron's tracker): `fork(name)` runs a block on that state and keeps
    where it left off. On CPU the states are torch's CPU generator's."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"random state {name} already exists")
        current = _get_rng_state()
        _manual_seed(seed)
        self.states[name] = _get_rng_state()
        _set_rng_state(current)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"random state {name} is not added")
        current = _get_rng_state()
        _set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_rng_state()
            _set_rng_state(current)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _cuda() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default generator gets `seed`, the tracker's model-parallel state
    seed + 2718 (model-parallel rank 0: every rank here)."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718)
