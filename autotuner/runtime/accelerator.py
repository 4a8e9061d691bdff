"""`get_accelerator()`: DeepSpeed's device abstraction, for CUDA and the CPU.

Scripts call it to name, pick, seed, synchronise and measure the device without writing
`torch.cuda` (8 of DeepSpeedExamples' 26 scripts). Return values follow DeepSpeed's CUDA and CPU
accelerators; on the CPU the memory queries read the process's resident set, as DeepSpeed's do.
One deliberate difference: the CPU's `current_device()` is an int (DeepSpeed returns LOCAL_RANK
as a string there, which no tensor call accepts).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import psutil
import torch

from autotuner.core.errors import ConfigError


class _Accelerator:
    _name = ""
    _communication_backend = ""

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend

    def random(self) -> Any:
        return torch.random

    def is_synchronized_device(self) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if hasattr(tensor, "is_pinned") else False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass

    def is_triton_supported(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()


class CudaAccelerator(_Accelerator):
    _name = "cuda"
    _communication_backend = "nccl"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return torch.cuda.get_device_capability()[0] >= 7

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback)


class CpuAccelerator(_Accelerator):
    _name = "cpu"
    _communication_backend = "gloo"

    def __init__(self) -> None:
        self._max_rss = 0

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed's CPU accelerator ignores the index

    def device(self, device_index: int | None = None) -> None:
        return None

    def set_device(self, device_index: int) -> None:
        pass

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """LOCAL_SIZE from the launcher, else the NUMA nodes with cores, as DeepSpeed counts them."""
        local_size = int(os.environ.get("LOCAL_SIZE", 0))
        if local_size > 0:
            return local_size
        cpu_lists = {path.read_text().strip() for path in Path("/sys/devices/system/node").glob("node*/cpulist")}
        return max(1, len({cpus for cpus in cpu_lists if cpus}))

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device_index: int | None = None) -> int:
        rss = psutil.Process().memory_info().rss
        self._max_rss = max(self._max_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return max(self._max_rss, self.memory_allocated())

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._max_rss = 0

    reset_peak_memory_stats = reset_max_memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(), "allocated_bytes.all.peak": self._max_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().available

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False  # our CPU engine trains fp16 configs only on CUDA (GradScaler)

    @property
    def Stream(self) -> None:  # noqa: N802
        return None

    @property
    def Event(self) -> None:  # noqa: N802
        return None

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None


_ACCELERATOR: _Accelerator | None = None
_NAMES = ("cuda", "cpu")


def get_accelerator() -> _Accelerator:
    """CUDA when a GPU is visible, else the CPU; DS_ACCELERATOR=cuda|cpu chooses, as in DeepSpeed."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        chosen = os.environ.get("DS_ACCELERATOR")
        if chosen is not None and chosen not in _NAMES:
            raise ConfigError(f"DS_ACCELERATOR: got {chosen!r}; autotuner supports {' or '.join(_NAMES)}")
        if chosen is None:
            chosen = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        _ACCELERATOR = CudaAccelerator() if chosen == "cuda" else CpuAccelerator()
    return _ACCELERATOR
