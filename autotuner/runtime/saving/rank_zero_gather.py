"""Whole weights on rank 0 alone, for scripts that save from one rank under FSDP2 or tensor parallelism.

DeepSpeedExamples' scripts end with `if rank == 0: torch.save(save_without_random_ltd(model), f)`,
DeepSpeed-Chat's with `if rank == 0: torch.save(model.module.state_dict(), f)`. Under DeepSpeed's
ZeRO 0-2 each rank holds the whole parameters, so one rank can read them; under our stages 2 and 3
(FSDP2) each holds a shard, and under tensor parallelism at stages 0-1 each rank of a TP group a
slice; gathering them is a collective the other ranks never join. So, armed at initialize wherever
FSDP2 shards over several ranks or tensor parallelism splits the model outside FSDP2, every other
rank serves its shards to rank 0 from a thread on a gloo group of its own, which the script's
process groups do not touch:

- rank 0 asks with its optimizer-step count; a serving rank waits until its engine has taken as
  many steps and is between steps, so the shards it sends belong to the same step as rank 0's;
- shards go point to point (gloo, on the host), in the state dict's order as it was at initialize,
  from the ranks of rank 0's mesh of each tensor (every rank under FSDP2, rank 0's TP group under
  tensor parallelism); rank 0 concatenates them along the sharded dim (torch.chunk's sizes: FSDP2
  shards dim 0 so, and the TP plan splits evenly); a replicated DTensor is rank 0's own. The serving thread
  reads the sharded parameters it noted then, never the module: a forward on the main thread
  (waiting for rank 0 in its all-gather) may be swapping the module's parameters, never the shards;
- a serving rank does not leave at the end of the script until rank 0 says it is done (rank 0
  says so at its own exit), so a save at the very end still finds every rank.
"""

from __future__ import annotations

import atexit
import datetime
import sys
import threading
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from autotuner.core.errors import UnsupportedError
from autotuner.runtime.training.sharding import is_dtensor

_GATHER, _DONE = 1, 0


class StepGate:
    """Lets another thread read the parameters only between optimizer steps, once a given number
    of steps is done."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._steps = 0
        self._in_step = False

    def enter_step(self) -> None:
        with self._condition:
            self._in_step = True

    def leave_step(self, steps_done: int) -> None:
        with self._condition:
            self._steps, self._in_step = steps_done, False
            self._condition.notify_all()

    @property
    def steps_done(self) -> int:
        return self._steps

    def hold_after(self, steps: int, timeout_s: float) -> "threading.Condition":
        """The gate's lock, held, once `steps` steps are done and none is in progress."""
        self._condition.acquire()
        if not self._condition.wait_for(lambda: self._steps >= steps and not self._in_step, timeout=timeout_s):
            self._condition.release()
            raise TimeoutError(f"the engine did not reach optimizer step {steps} within {timeout_s:.0f} s")
        return self._condition


class RankZeroGather:
    """One job's gather service: `whole_state_dict` on rank 0, `serve` on a thread elsewhere."""

    def __init__(self, module: torch.nn.Module, gate: StepGate, timeout_s: float):
        self.module, self.gate, self.timeout_s = module, gate, timeout_s
        # The sharded parameters themselves (the optimizer updates them in place), by state-dict key.
        self.shards = [(key, value) for key, value in module.state_dict(keep_vars=True).items() if is_dtensor(value)]
        check_gatherable(dict(self.shards))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = _private_gloo_group(self.rank, self.world_size, timeout_s)
        self._done = threading.Event()
        self._exiting_cleanly = True
        if self.rank == 0:
            atexit.register(self._release)
        else:
            threading.Thread(target=self._serve, name="autotuner-rank-zero-gather", daemon=True).start()
            previous = sys.excepthook

            def failed(kind, err, traceback):  # a rank that failed must not wait for rank 0 at exit
                self._exiting_cleanly = False
                previous(kind, err, traceback)

            sys.excepthook = failed
            atexit.register(self._wait_for_rank_zero)

    # ----- rank 0 -----
    def whole_state_dict(self, state: dict) -> dict:
        """`state` (this rank's, with DTensor shards) with every shard replaced by the whole tensor."""
        self.group.broadcast(torch.tensor([_GATHER, self.gate.steps_done]), 0).wait()
        whole = {key: self._gathered(value) for key, value in self.shards}
        out = OrderedDict()
        for key, value in state.items():
            if is_dtensor(value) and key not in whole:
                raise UnsupportedError(f"save_without_random_ltd: {key} was not a parameter at initialize; one rank "
                                       "can gather only those; save with engine.save_16bit_model(dir) on every rank")
            out[key] = whole[key] if is_dtensor(value) else value
        return out

    def _gathered(self, value: Any) -> torch.Tensor:
        dim = _sharded_dim(value)
        if dim is None:  # replicated: rank 0 holds it whole
            return value.to_local().detach().cpu()
        ranks = value.device_mesh.mesh.flatten().tolist()
        pieces = []
        for rank, rows in zip(ranks, _chunk_rows(value.shape[dim], len(ranks))):
            if rows == 0:
                continue
            if rank == 0:
                pieces.append(value.to_local().detach().cpu())
            else:
                shape = list(value.shape)
                shape[dim] = rows
                piece = torch.empty(shape, dtype=value.dtype)
                self.group.recv([piece], rank, 0).wait()
                pieces.append(piece)
        return torch.cat(pieces, dim=dim) if pieces else torch.empty(value.shape, dtype=value.dtype)

    def _release(self) -> None:
        try:
            self.group.broadcast(torch.tensor([_DONE, 0]), 0).wait()
        except Exception:  # the others are gone already: nothing to release
            pass

    # ----- every other rank -----
    def _serve(self) -> None:
        try:
            while True:
                request = torch.zeros(2, dtype=torch.int64)
                self.group.broadcast(request, 0).wait()
                if int(request[0]) == _DONE:
                    return
                lock = self.gate.hold_after(int(request[1]), self.timeout_s)
                try:
                    for _key, value in self.shards:
                        local = value.to_local().detach()
                        if local.numel() and _sharded_dim(value) is not None and _serves_rank_zero(value):
                            self.group.send([local.contiguous().cpu()], 0, 0).wait()
                finally:
                    lock.release()
        except Exception:  # the group ended (the job is over, or rank 0 failed): stop serving
            return
        finally:
            self._done.set()

    def _wait_for_rank_zero(self) -> None:
        if self._exiting_cleanly:
            self._done.wait(self.timeout_s)


_groups_made = 0


def _private_gloo_group(rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo group of the job's ranks that c10d does not know: requests are never matched against
    the script's collectives, and a script's destroy_process_group() at its end (a rank that got
    there first) does not end it while rank 0 still gathers. Made like new_group: every rank, at once."""
    from torch.distributed.distributed_c10d import _get_default_store

    global _groups_made
    _groups_made += 1
    store = dist.PrefixStore(f"autotuner-rank-zero-gather-{_groups_made}", _get_default_store())
    return dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))


def _chunk_rows(rows: int, world_size: int) -> list[int]:
    """Rows of each rank's shard: torch.chunk's sizes, then empty shards."""
    sizes = [len(chunk) for chunk in torch.chunk(torch.empty(rows, 0), world_size)] if rows else []
    return sizes + [0] * (world_size - len(sizes))


def _sharded_dim(value: Any) -> int | None:
    """The dim a DTensor on a one-dimensional mesh is sharded along; None where it is replicated."""
    placement = value.placements[0]
    return placement.dim if placement.is_shard() else None


def _serves_rank_zero(value: Any) -> bool:
    """Whether rank 0 gathers this tensor from this rank: its mesh holds rank 0 (under tensor
    parallelism the other data-parallel replicas' TP groups hold copies rank 0 does not need)."""
    return 0 in value.device_mesh.mesh.flatten().tolist()


def check_gatherable(state: dict[str, Any]) -> None:
    """The gather reads DTensors on a one-dimensional mesh, sharded along one dim (FSDP2's dim 0, a
    TP plan's column or row split) or replicated; FSDP2 over split parameters (a 2-D mesh) is not."""
    for key, value in state.items():
        if is_dtensor(value) and (value.device_mesh.ndim != 1 or not (value.placements[0].is_shard()
                                                                       or value.placements[0].is_replicate())):
            raise UnsupportedError(f"{key}: sharded as {value.placements} on a {value.device_mesh.ndim}-D mesh; "
                                   "one rank can gather only shards of a one-dimensional mesh (FSDP2's, or tensor "
                                   "parallelism's at ZeRO 0-1); save with engine.save_16bit_model(dir) on every rank")


_service: RankZeroGather | None = None


def arm(module: torch.nn.Module, stage: int, world_size: int, gate: StepGate, timeout_s: float,
        split: bool = False) -> RankZeroGather | None:
    """Start the service where FSDP2 shards the weights over several ranks, or tensor parallelism
    splits them outside FSDP2 (`split` at stages 0-1; with FSDP2 as well the 2-D shards are refused
    by the gather's check) (collective: every rank of the job calls initialize alike): a script may
    save from rank 0 alone at any time."""
    global _service
    if (stage >= 2 or split) and world_size > 1:
        _service = RankZeroGather(module, gate, timeout_s)
        return _service
    return None


def service_for(module: torch.nn.Module) -> RankZeroGather | None:
    return _service if _service is not None and _service.module is module else None
