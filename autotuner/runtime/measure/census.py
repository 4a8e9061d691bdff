"""A plan's run of the user's script for hardware that is not here (`--autotuning plan --hardware`,
issue 80 part 3): one process standing for rank 0 of a fake world, the model on the meta device.

    python -m autotuner.runtime.measure.census_run SCRIPT ARGS...   (the plan starts it; AUTOTUNER_CENSUS_RECORD set)

Before the script runs: torch's default device is the meta device (so `from_config` and module
constructors allocate nothing, and tensors the script makes are shapes only) and the default
process group is torch's fake one over AUTOTUNER_CENSUS_WORLD ranks (its collectives do nothing).
`initialize` then returns a census engine: `engine(...)` runs the model's forward under the
operator census (runtime/measure/op_census.py) and the saved-tensor probe, `engine.backward(loss)`
its backward, and `engine.step()` writes the record and ends the process. A model with a parameter
off the meta device (weights loaded, a `.to(device)` before initialize) is refused in one line:
the plan would otherwise hold this machine's memory to a model the hardware holds."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn

from autotuner.core.errors import ConfigError, UnsupportedError

RECORD_ENV = "AUTOTUNER_CENSUS_RECORD"
WORLD_ENV = "AUTOTUNER_CENSUS_WORLD"
DEGREES_ENV = "AUTOTUNER_CENSUS_DEGREES"  # tensor-parallel degrees the plan asks about, comma-separated


def census_degrees() -> tuple[int, ...]:
    return tuple(int(d) for d in os.environ.get(DEGREES_ENV, "").split(",") if d.strip())


def census_requested() -> bool:
    return bool(os.environ.get(RECORD_ENV))


class CensusEngine:
    """What `initialize` returns in a plan's census: forward, backward and step counted, once."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module], micro_batch_size: int, record_path: str,
                 styles: tuple[tuple[str, str], ...] = (), degrees: tuple[int, ...] = (),
                 dtype: torch.dtype | None = None, config: Any = None):
        from autotuner.runtime.measure.op_census import OpCensus
        from autotuner.runtime.measure.profile import ActivationProbe

        # What the script's process holds before the engine: its imports and data (the model is on
        # meta). A CPU rank's memory is its resident set, this included; read before the census grows it.
        self._resident_bytes = psutil.Process().memory_info().rss
        self.module = module.to(dtype) if dtype is not None else module  # (free on the meta device)
        self.device = torch.device("meta")
        self._micro_batch_size = micro_batch_size
        self._record_path = record_path
        self._census = OpCensus(blocks)
        self._probe = ActivationProbe(list(module.parameters()), blocks=blocks, model=module)
        if styles:  # what a tensor-parallel plan would split, counted at degree 1 (as a profile's probe does)
            self._probe.watch_split_regions(module, styles)
        self._degrees = degrees
        self._blocks = len(blocks)
        self._forwards = 0
        # What a script reads of the engine before its first step (DeepSpeed's accessors), as the
        # planned run would answer them: the config's batch triad over the fake world.
        self.config = config
        gas = getattr(config, "gradient_accumulation_steps", None)
        self._gas = gas if isinstance(gas, int) else 1
        stage = getattr(getattr(config, "zero_optimization", None), "stage", 0)
        self.zero_stage = stage if isinstance(stage, int) else 0
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.dp_world_size = self.world_size
        self.global_steps = 0
        self.global_samples = 0

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_batch_size(self) -> int:
        return self._micro_batch_size * self._gas * self.dp_world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._forwards:
            raise UnsupportedError("a plan's census counts one micro-step: the script's second forward came before "
                                   "engine.step(); call backward and step after each forward")
        self._forwards += 1
        args, kwargs = _to_meta((args, kwargs))
        self._census.__enter__()
        self._probe.start()
        try:
            return self.module(*args, **kwargs)
        finally:
            self._probe.stop()

    def backward(self, loss: torch.Tensor, **_: Any) -> None:
        """Counts the backward, then writes the record and leaves: what a script does between its
        backward and step (a loss.item() for its log) the meta device cannot answer, and the
        census counts nothing there."""
        self._census.phase = "backward"
        try:
            loss.backward()
        finally:
            self._census.__exit__(None, None, None)
        self._write_and_leave()

    def step(self, *_: Any, **__: Any) -> None:
        self._write_and_leave()

    def _write_and_leave(self) -> None:
        Path(self._record_path).write_text(json.dumps(self._record()))
        raise SystemExit(0)

    def _record(self) -> dict[str, Any]:
        params = list(self.module.parameters())
        return {"num_params": sum(p.numel() for p in params), "parameter_tensors": len(params),
                "trainable_params": sum(p.numel() for p in params if p.requires_grad),
                "micro_batch_size": self._micro_batch_size, "blocks": self._blocks,
                "sequence_length": self._probe.sequence_length,
                "activation_bytes": self._probe.bytes_saved,
                "activation_bytes_by_policy": self._probe.bytes_by_policy(),
                "split": dataclasses.asdict(self._probe.split_regions()) if self._degrees else {},
                "degrees": list(self._degrees), "resident_bytes": self._resident_bytes,
                "records": [[r.op, r.flops, r.bytes, r.phase, r.block] for r in self._census.records]}

    def zero_grad(self, *_: Any, **__: Any) -> None:
        return None

    def train(self, mode: bool = True) -> "CensusEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "CensusEngine":
        self.module.eval()
        return self

    def __getattr__(self, name: str) -> Any:
        raise _NotCounted(f"engine.{name}: a plan's census (--hardware) runs forward, backward and step once; "
                          "the script called what it does not count")


class _NotCounted(UnsupportedError, AttributeError):
    """(an AttributeError too: a script's hasattr(engine, ...) reads False, as for any missing attribute)"""


class _CensusLoader:
    """The training data in micro-batches, in order (a DataLoader draws its seed with .item(), which
    the meta device cannot answer); one micro-batch is all a census reads."""

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Any):
        from torch.utils.data import default_collate

        self._dataset, self._batch_size, self._collate = dataset, batch_size, collate_fn or default_collate

    def __len__(self) -> int:
        return len(self._dataset) // self._batch_size

    @property
    def sampler(self) -> "_CensusLoader":
        return self  # (in order: set_epoch changes nothing)

    def set_epoch(self, epoch: int) -> None:
        return None

    def __iter__(self):
        for start in range(0, len(self) * self._batch_size, self._batch_size):
            yield self._collate([self._dataset[i] for i in range(start, start + self._batch_size)])


def _to_meta(value: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) and v.device.type != "meta" else v, value)


def check_on_meta(model: nn.Module) -> None:
    """A model with a parameter off the meta device is refused in one line."""
    off = next(((name, p.device) for name, p in model.named_parameters() if p.device.type != "meta"), None)
    if off is not None:
        raise ConfigError(f"--hardware: parameter {off[0]} is on {off[1]}, not the meta device: the plan runs the "
                          "script with torch's default device set to meta so nothing is allocated; build the model "
                          "from its config (no weights loaded, no .to(device)) before initialize")


def census_initialize(model: nn.Module, blocks: list[nn.Module], micro_batch_size: int, training_data: Any,
                      collate_fn: Any, styles: tuple[tuple[str, str], ...] = (), degrees: tuple[int, ...] = (),
                      dtype: torch.dtype | None = None, config: Any = None) -> tuple:
    """initialize's return under a census: (engine, None, a loader over training_data, None);
    `blocks`: the model's repeated blocks (what checkpointing recomputes, FSDP2 shards); `styles`
    and `degrees`: the tensor-parallel plan's Linears and the degrees of those asked it can take;
    `dtype`: the compute precision the model is counted in (the engine's bf16 or fp16 copy);
    `config`: the run's config, which the engine's accessors answer from."""
    check_on_meta(model)
    loader = _CensusLoader(training_data, micro_batch_size, collate_fn) if training_data is not None else None
    engine = CensusEngine(model, blocks, micro_batch_size, os.environ[RECORD_ENV], styles, degrees, dtype, config)
    return engine, None, loader, None
