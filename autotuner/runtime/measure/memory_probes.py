"""Memory measurements a rank takes for the tuner: the CUDA allocator's peaks by phase, and the
OOM marker that tells the tuner an experiment ran out of memory (rather than crashed)."""

from __future__ import annotations

import os
import sys

import torch

from autotuner.runtime.measure.metrics import is_out_of_memory, write_json_atomic


class PhasePeaks:
    """The CUDA allocator's peak in one step's forward+backward and, apart, in its optimizer step.
    The overall peak since the start is kept: resetting the counters must not hide it."""

    def __init__(self) -> None:
        self.forward_backward_bytes = 0
        self.optimizer_step_bytes = 0
        self.before_bytes = 0

    def start(self, device: torch.device) -> None:
        self.before_bytes = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    def end_forward_backward(self, device: torch.device) -> None:
        self.forward_backward_bytes = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    def end_optimizer_step(self, device: torch.device) -> None:
        self.optimizer_step_bytes = int(torch.cuda.max_memory_allocated(device))


def write_oom_marker(path: str, rank: int, err: BaseException) -> None:
    write_json_atomic(path, {"rank": rank, "error": str(err)[:500]})


def mark_uncaught_oom(path: str, rank: int) -> None:
    """An out-of-memory error raised outside the engine's calls (the script moving a batch to the
    GPU, say) still leaves the marker, so the tuner records OOM rather than a crash."""
    previous = sys.excepthook

    def hook(kind, err, traceback):
        if is_out_of_memory(err) and not os.path.exists(path):
            write_oom_marker(path, rank, err)
        previous(kind, err, traceback)

    sys.excepthook = hook


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (their local shards under FSDP2)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
