"""Process-group set-up from the launcher's environment (torch elastic's env:// variables)."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autotuner.core.boundary import DIST_TIMEOUT_ENV
from autotuner.core.parent_death import die_with_parent


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str


_GLOO_DRAIN_S = 0.2  # ample for a worker thread to take the GIL once; paid once per rank, at exit


def end_process_group() -> None:
    """End the default process group while the interpreter is whole, as torchrun's docs ask
    scripts to. Left to interpreter teardown, a freed DDP reducer and gloo's threads can abort a
    rank at exit ("terminate called without an active exception", status 134) after training
    finished.

    Also when the script ended the group itself: a gloo worker thread frees each collective's
    work after the caller's wait returned, and freeing its tensors takes the GIL. Should the
    interpreter be finalising by then, that thread exits inside a C++ destructor and the rank
    aborts (seen after a last broadcast just before exit). Sleeping hands the GIL over first."""
    if not dist.is_available():
        return
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_GLOO_DRAIN_S)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A warning printed once per job: by global rank 0 only, and once per message."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if rank == 0 and message not in _warned:
        _warned.add(message)
        print(f"autotuner: warning: {message}", file=sys.stderr, flush=True)


def dist_timeout_s(timeout_s: float = 1800.0) -> float:
    """How long a wait on another rank may last: the tuner's limit for its launches, else `timeout_s`."""
    if os.environ.get(DIST_TIMEOUT_ENV):  # a tuner's launch: no wait outlives the experiment's time limit
        return min(timeout_s, float(os.environ[DIST_TIMEOUT_ENV]))
    return timeout_s


def select_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 1800.0, *, default_port: int = 29500, backend: str | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1) -> DistributedContext:
    """Join (or reuse) the default process group: nccl on CUDA, gloo on CPU.

    Without launcher variables (and no init_method) it forms a world of one, so a plain
    `python train.py` works. `default_port` stands in for a missing MASTER_PORT.
    """
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    timeout_s = dist_timeout_s(timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = select_device(local_rank)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if device.type == "cuda" and backend == "nccl" else {}
        if init_method is not None or rank >= 0:
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout, **kwargs)
        elif launched:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(default_port))
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        if dist.get_backend() == "gloo":
            # A plain launch's script may never end the group itself; gloo's is local to end.
            atexit.register(end_process_group)
    world_size = dist.get_world_size()
    return DistributedContext(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        device=device,
        backend=dist.get_backend(),
    )
