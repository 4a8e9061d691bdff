"""What the tuner reads of this machine: the GPU without making a CUDA context (the ranks need its
memory), and the host's memory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceFacts:
    """The device facts a tuning run uses, read once by the settle pass (read_device_facts)."""

    gpu_memory_bytes: int | None  # the first visible GPU's total memory; None without a GPU
    cuda_bf16: bool
    host_memory_bytes: int = 0  # this machine's RAM: a CPU run's budget without memory_per_rank

    @property
    def on_gpu(self) -> bool:
        return self.gpu_memory_bytes is not None


def read_device_facts() -> DeviceFacts:
    import psutil

    return DeviceFacts(visible_gpu_memory(), cuda_bf16(), psutil.virtual_memory().total)


def visible_gpu_memory() -> int | None:
    """The first visible GPU's total memory, or None without one. Reads the device's properties
    only: no CUDA context is made in the tuner, whose memory the ranks need."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except ImportError:
        pass
    return None


def cuda_bf16() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except ImportError:
        return False
