"""`autotuner.accelerator`, where DeepSpeed scripts import `get_accelerator` from."""

from autotuner.runtime.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator

__all__ = ["CpuAccelerator", "CudaAccelerator", "get_accelerator"]
