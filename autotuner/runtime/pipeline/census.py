"""A plan's census of a script that trains a PipelineModule with `engine.train_batch()` (DeepSpeed's
pipeline API; `--autotuning plan --hardware`, runtime/measure/census.py).

One process counts every stage: the module is rebuilt holding all its layers on the meta device
(PipelineModule.hold_every_layer), and `train_batch` runs one micro-batch through them in order,
then the module's loss_fn, then the backward. Each layer is a block of the operator census and of
the saved-tensor probe, so the record says, layer by layer, the forward's operators, the bytes
saved for backward and the bytes of its output (what a stage boundary after it sends on), with
each layer's class name and trainable parameters (what the module's partition_method splits by),
the parameters it holds and its tie key (a tied module's parameters are held by each stage that
runs it). The plan splits that count into stages itself (app/pipeline_plan.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autotuner.runtime.measure.census import CensusEngine, _CensusLoader, _to_meta


class _Layer(nn.Module):
    """One pipeline layer as a module of its own (a layer may be a plain callable, or a tied module
    run twice), so the census' hooks see where each begins and ends. The layer is held outside
    the module tree: its parameters stay the PipelineModule's."""

    def __init__(self, function: Any):
        super().__init__()
        object.__setattr__(self, "_function", function)
        self.output_bytes = 0

    def forward(self, x: Any) -> Any:
        out = self._function(x)
        tensors = out if isinstance(out, (tuple, list)) else (out,)
        self.output_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return out


class _EveryStage(nn.Module):
    """The PipelineModule's layers in order, as one model: what every stage runs, end to end."""

    def __init__(self, pipe: nn.Module, layers: list[_Layer]):
        super().__init__()
        self.pipe = pipe
        object.__setattr__(self, "_layers", layers)

    def forward(self, inputs: Any) -> Any:
        x = inputs
        for layer in self._layers:
            x = layer(x)
        return x


class PipelineCensusEngine(CensusEngine):
    """What `initialize` returns for a PipelineModule in a plan's census: `train_batch` counted once."""

    def __init__(self, pipe: nn.Module, micro_batch_size: int, record_path: str, training_data: Any,
                 collate_fn: Any, dtype: torch.dtype | None = None, config: Any = None):
        from autotuner.runtime.pipeline.layer_spec import TiedLayerSpec, layer_name, trainable_count

        pipe.hold_every_layer()
        self._layers = [_Layer(function) for function in pipe.forward_funcs]
        self._loss_fn = pipe.loss_fn
        specs = pipe.layer_specs
        self._layer_facts = [{"name": layer_name(spec), "trainable_params": trainable_count(spec),
                              "tied": spec.key if isinstance(spec, TiedLayerSpec) else None} for spec in specs]
        held = [list(function.parameters()) if isinstance(function, nn.Module) else [] for function in pipe.forward_funcs]
        self._held_params = [sum(p.numel() for p in params) for params in held]
        self._held_tensors = [len(params) for params in held]
        # (held once by each stage that runs the key)
        self._tied = {key: [sum(p.numel() for p in module.parameters()), len(list(module.parameters()))]
                      for key, module in pipe.tied_modules.items()}
        self._partition_method, self._script_stages = pipe.partition_method, pipe.num_stages
        self._checkpoint_interval = pipe.activation_checkpoint_interval
        super().__init__(_EveryStage(pipe, self._layers), self._layers, micro_batch_size, record_path, dtype=dtype,
                         config=config)
        loader = _CensusLoader(training_data, micro_batch_size, collate_fn) if training_data is not None else None
        self.training_dataloader = loader
        self.data_iterator = iter(loader) if loader is not None else None
        self.stage_id, self.num_stages = 0, pipe.num_stages

    def is_first_stage(self) -> bool:
        return True  # (this one process runs every stage)

    def is_last_stage(self) -> bool:
        return True

    def set_dataiterator(self, iterator: Any) -> None:
        self.data_iterator = iterator

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One micro-batch forward through every layer, the loss, its backward; then the record."""
        source = data_iter if data_iter is not None else self.data_iterator
        if source is None:
            from autotuner.core.errors import ConfigError

            raise ConfigError("--hardware: train_batch() without a data iterator, and initialize was given no "
                              "training_data; pass one of them, as DeepSpeed's pipeline engine needs")
        batch = _to_meta(next(iter(source)) if not hasattr(source, "__next__") else next(source))
        inputs, labels = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
        out = self.forward(inputs)
        loss = out if self._loss_fn is None else self._loss_fn(out, labels)
        self.backward(loss)
        return loss  # (not reached: backward writes the record and ends the process)

    def _record(self) -> dict[str, Any]:
        record = super()._record()
        saved, outside = self._probe.saved_by_block()
        record["pipeline"] = {
            "layers": [{**facts, "held_params": held, "held_tensors": tensors, "saved_bytes": int(bytes_),
                        "output_bytes": layer.output_bytes}
                       for facts, held, tensors, bytes_, layer in zip(self._layer_facts, self._held_params,
                                                                      self._held_tensors, saved, self._layers)],
            "tied": self._tied, "saved_outside_bytes": int(outside), "partition_method": self._partition_method,
            "script_stages": self._script_stages, "activation_checkpoint_interval": self._checkpoint_interval}
        return record


def pipeline_census_initialize(pipe: nn.Module, micro_batch_size: int, training_data: Any, collate_fn: Any,
                               dtype: torch.dtype | None = None, config: Any = None) -> tuple:
    """initialize's return for a PipelineModule under a census: (engine, None, its loader, None)."""
    import os

    from autotuner.runtime.measure.census import RECORD_ENV, check_on_meta

    check_on_meta(pipe)
    engine = PipelineCensusEngine(pipe, micro_batch_size, os.environ[RECORD_ENV], training_data, collate_fn, dtype,
                                  config)
    return engine, None, engine.training_dataloader, None
