"""The measurement an experiment leaves for the tuner, and peak-memory measurement."""

from __future__ import annotations

import resource

import torch

from autotuner.core.atomic import write_json_atomic  # noqa: F401  (re-exported for the engine)
from autotuner.core.boundary import Measurement, Summary
from autotuner.runtime.measure.timers import ProfileWindow


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing (e.g. under RLIMIT_AS)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak: the CUDA allocator's on GPU, the resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _resident_high_water_mark()


def peak_reserved_bytes(device: torch.device) -> int | None:
    """The CUDA caching allocator's peak reservation (what the device really gave up); None on CPU,
    where the resident set already is what the process holds."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def _resident_high_water_mark() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def build_measurement(
    window: ProfileWindow,
    *,
    train_batch_size: int,
    world_size: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    zero_stage: int,
    precision: str,
    peak_memory: int,
    peak_memory_per_rank: list[int],
    peak_reserved_per_rank: list[int] | None = None,
    flops_per_step: float | None,
    device_type: str,
    cpu_taken_by_others: float | None = None,
    load_average: float | None = None,
) -> Measurement:
    """The profile window's measurement. Throughput uses end-to-end step time (data loading included)."""
    wall = Summary.of(window.step_wall_s)
    latency = wall.mean_s
    return Measurement(
        throughput=train_batch_size / latency if latency > 0 else 0.0,
        throughput_std=_throughput_spread(window.step_wall_s, train_batch_size),
        latency=latency,
        step_wall_s=wall,
        step_wall_s_values=tuple(float(s) for s in window.step_wall_s),
        forward=Summary.of(window.forward_s),
        backward=Summary.of(window.backward_s),
        step=Summary.of(window.step_s),
        peak_memory_bytes=peak_memory,
        peak_memory_bytes_per_rank=tuple(peak_memory_per_rank),
        peak_reserved_bytes=max(peak_reserved_per_rank) if peak_reserved_per_rank else None,
        world_size=world_size,
        train_batch_size=train_batch_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        zero_stage=zero_stage,
        precision=precision,
        device_type=device_type,
        start_profile_step=window.start_step,
        end_profile_step=window.start_step + len(window.step_wall_s) - 1,
        FLOPS_per_gpu=flops_per_step / latency if flops_per_step and latency > 0 else None,
        cpu_taken_by_others=cpu_taken_by_others,
        load_average=load_average,
        warmup_steps=window.warmup_steps,
        warmup_s=window.warmup_s,
    )


def _throughput_spread(step_wall_s: list[float], train_batch_size: int) -> float:
    rates = [train_batch_size / s for s in step_wall_s if s > 0]
    return Summary.of(rates).std_s
