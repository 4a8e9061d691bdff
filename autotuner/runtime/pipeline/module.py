"""`deepspeed.pipe.PipelineModule` as DeepSpeed defines it (its `LayerSpec` and `TiedLayerSpec`:
layer_spec.py).

A PipelineModule is a list of layers (modules, specs that build one, or plain callables such as
a flatten lambda) split over `num_stages` stages. Each rank builds only its own stage's layers
from their specs, so a stage never holds another's weights. Layers pass one value on, a tensor
or a tuple, never unpacked. Parameter names keep the layer's global index ("16.weight"), tied
layers live in `tied_modules.<key>`, as in DeepSpeed's checkpoints.

Tied layers (an embedding and its output head) keep one weight per key: the stages that hold
it start from the first one's copy (a broadcast), and after each batch's backward passes its
gradients are summed over them, before the data-parallel average, as DeepSpeed does."""

from __future__ import annotations

import functools
import os
import random
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from autotuner.core.errors import ConfigError
from autotuner.runtime.distributed import init_distributed
from autotuner.runtime.pipeline.chunks import Chunk, run_chunk
from autotuner.runtime.pipeline.layer_spec import LayerSpec, TiedLayerSpec, layer_name, trainable_count
from autotuner.runtime.pipeline.partition import parts_for
from autotuner.runtime.pipeline.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def set_random_seed(seed: int) -> None:
    """Seed Python, numpy (when installed) and torch on every device, as DeepSpeed's
    runtime.utils.set_random_seed does (deepspeed_paths re-exports this one)."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed % 2**63)


def _seed(seed: int, seed_fn: Callable[[int], None] | None) -> None:
    (seed_fn or set_random_seed)(seed)


def _attr(module: nn.Module, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), module)


class PipelineModule(nn.Module):
    """DeepSpeed's PipelineModule: this rank's stage of `layers`, split by `partition_method`.
    Needs the process group (started here from the launcher's environment where the script has
    not started it)."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False):
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")  # DeepSpeed's words
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ConfigError("PipelineModule(checkpointable_layers=...): expected a list of layer class names")
        if activation_checkpoint_interval < 0:
            raise ConfigError(f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}): "
                              "expected 0 (off) or a positive number of layers per checkpointed chunk")
        self.ctx = init_distributed() if not dist.is_initialized() else None
        world, rank = dist.get_world_size(), dist.get_rank()
        if topology is None:
            if world % num_stages:
                raise ConfigError(f"PipelineModule(num_stages={num_stages}): must divide the number of ranks "
                                  f"({world}); the data-parallel size is ranks / num_stages")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        if topology.world_size() != world:
            raise ConfigError(f"PipelineModule(topology=...): the topology holds {topology.world_size()} ranks, the "
                              f"world {world}")
        self.layer_specs = list(layers)
        if not self.layer_specs:
            raise ConfigError("PipelineModule(layers=[]): no layers to split into stages")
        self.num_stages = topology.get_dim("pipe")
        if self.num_stages > len(self.layer_specs):
            raise ConfigError(f"PipelineModule: {self.num_stages} stages for {len(self.layer_specs)} layers; a "
                              f"stage needs at least one layer, so use at most {len(self.layer_specs)} stages")
        self._topo = topology
        self.global_rank = rank
        self.stage_id = topology.get_coord(rank).pipe
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.partition_method = partition_method
        self.parts = self._split(self.num_stages, f"PipelineModule(partition_method={partition_method!r}): stage",
                                 "use fewer stages or another partition_method")
        self.stages_per_rank = 1  # virtual stages this rank runs (place_virtual_stages)
        self.v_shaped = False  # the two chunks a rank runs placed r and 2 pp - 1 - r, not r, r + pp, ...
        self._autocast_dtype: torch.dtype | None = None  # the engine's bf16 (compute_in)
        self._place()

    def _place(self) -> None:
        """Build this rank's layers for the current parts: its stage's, or with virtual stages the
        chunks stage_id, stage_id + pp, ... (torch's looped placement) or stage_id and
        2 pp - 1 - stage_id (its V), then tie and broadcast."""
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.local_stages = [v for v in range(self.num_stages * self.stages_per_rank)
                             if self.rank_of_virtual_stage(v) == self.stage_id]
        self.chunk_funcs: list[list[Callable]] = []
        self.chunk_modules: list[list[nn.Module]] = []
        for virtual in self.local_stages:
            funcs, modules = self._build(self.parts[virtual], self.parts[virtual + 1])
            self.chunk_funcs.append(funcs)
            self.chunk_modules.append(modules)
        self.forward_funcs: list[Callable] = [f for funcs in self.chunk_funcs for f in funcs]
        self._local_layers = {i for v in self.local_stages for i in range(self.parts[v], self.parts[v + 1])}
        device = self.ctx.device if self.ctx is not None else _device_of_group()
        self.to(device)
        self.tied_comms = self._tie_groups()
        self._broadcast_tied_weights()

    def place_virtual_stages(self, per_rank: int, v_shaped: bool = False) -> None:
        """Split the layers into stages x `per_rank` virtual stages by the module's partition_method,
        rank r running chunks r, r + stages, ... (what torch's interleaved and looped schedules
        take), or with `v_shaped` (2 a rank) chunks r and 2 stages - 1 - r (torch's ZBV and
        DualPipeV), and rebuild this rank's layers for them (collective: the ties are regrouped).
        Layer specs are built again (with seed_layers, each from its index's seed: the same
        weights), modules the script passed are reused."""
        if (per_rank, v_shaped) == (self.stages_per_rank, self.v_shaped):
            return
        if v_shaped and per_rank != 2:
            raise ConfigError(f"pipeline.stages_per_rank {per_rank}: a V places exactly 2 stages on each rank")
        total = self.num_stages * per_rank
        if total > len(self.layer_specs):
            raise ConfigError(f"pipeline.stages_per_rank {per_rank}: {self.num_stages} stages x {per_rank} chunks for "
                              f"{len(self.layer_specs)} layers; a chunk needs at least one layer")
        parts = self._split(total, f"pipeline.stages_per_rank {per_rank}: virtual stage",
                            f"use fewer (partition_method {self.partition_method!r})")
        for index in range(len(self.layer_specs)):
            if str(index) in self._modules:
                del self._modules[str(index)]
        self.parts, self.stages_per_rank, self.v_shaped = parts, per_rank, v_shaped
        self._place()

    def hold_every_layer(self) -> None:
        """Build every layer on this rank, as one stage holding the model (a plan's census counts the
        whole model on the meta device, then splits the count by stage itself). No ties to regroup:
        a tied module is built once and run wherever its key appears."""
        for index in range(len(self.layer_specs)):
            self._modules.pop(str(index), None)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        funcs, modules = self._build(0, len(self.layer_specs))
        self.chunk_funcs, self.chunk_modules = [funcs], [modules]
        self.forward_funcs = funcs
        self._local_layers = set(range(len(self.layer_specs)))

    def rank_of_virtual_stage(self, virtual: int) -> int:
        """The pipeline rank that runs virtual stage `virtual` under the current placement."""
        if self.v_shaped:
            return virtual if virtual < self.num_stages else 2 * self.num_stages - 1 - virtual
        return virtual % self.num_stages

    def _split(self, count: int, what: str, remedy: str) -> list[int]:
        """The layers' boundaries over `count` stages by the partition method; a stage left
        without a layer refused in one line (`what` names it, `remedy` says what to do)."""
        parts = parts_for(self.partition_method, [layer_name(layer) for layer in self.layer_specs],
                          [trainable_count(layer) for layer in self.layer_specs], count)
        empty = [s for s in range(count) if parts[s] == parts[s + 1]]
        if empty:
            raise ConfigError(f"{what} {empty[0]} gets no layer (boundaries {parts}); {remedy}")
        return parts

    def chunks(self) -> list[tuple[int, nn.Module]]:
        """(virtual stage index, the module that runs it) for each chunk on this rank, in order. The
        chunk modules are not registered here, so parameter names stay by global layer index."""
        return [(virtual, Chunk(self, funcs, modules))
                for virtual, funcs, modules in zip(self.local_stages, self.chunk_funcs, self.chunk_modules)]

    def holds_layer(self, index: int) -> bool:
        return index in self._local_layers

    # ----- building this stage -----
    def _build(self, start: int, stop: int) -> tuple[list[Callable], list[nn.Module]]:
        """Layers start..stop of this rank: their forward functions, and the modules holding
        their parameters (a tied one once per chunk)."""
        funcs: list[Callable] = []
        modules: list[nn.Module] = []
        for index in range(start, stop):
            layer = self.layer_specs[index]
            if self.seed_layers:
                _seed(self.base_seed + index, self.seed_fn)
            if isinstance(layer, PipelineModule):
                raise ConfigError("PipelineModule(layers=...): a PipelineModule inside another is not supported "
                                  "(nor by DeepSpeed); give its layers instead")
            if isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                funcs.append(layer)
                modules.append(layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                # (In two chunks of one rank, a V's embedding and head: one weight, whose gradient both
                # chunks' backwards accumulate; the engine scales each gradient once, not per chunk.)
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else functools.partial(layer.forward_fn, module))
                if not any(m is module for m in modules):
                    modules.append(module)
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(index), module)
                funcs.append(module)
                modules.append(module)
            elif callable(layer):
                funcs.append(layer)
            else:
                raise ConfigError(f"PipelineModule(layers=...): layer {index} is a {type(layer).__name__}; expected "
                                  "a module, a LayerSpec or a callable")
        return funcs, modules

    def _tie_groups(self) -> dict[str, dict[str, Any]]:
        """For each tied key held by more than one stage, one group per pipeline (same data-parallel
        coordinate) of the ranks of those stages. Collective: every rank creates every group."""
        owners: dict[str, list[int]] = {}
        for index, layer in enumerate(self.layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = self.stage_owner(index)
                owners.setdefault(layer.key, [])
                if stage not in owners[layer.key]:
                    owners[layer.key].append(stage)
        comms: dict[str, dict[str, Any]] = {}
        for key in sorted(owners):
            stages = sorted(owners[key])
            if len(stages) < 2:
                continue
            for pipe in self._topo.get_axis_comm_lists("pipe"):  # one pipeline: every other axis fixed
                ranks = [pipe[s] for s in stages]
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                  "module": self.tied_modules[key]}
        for key, comm in comms.items():
            if self.global_rank != comm["ranks"][0]:
                for attr in comm["weight_attr"]:  # the copy beside the first stage's: counted once in a norm
                    _attr(comm["module"], attr).ds_pipe_replicated = True
        return comms

    def _broadcast_tied_weights(self) -> None:
        with torch.no_grad():
            for comm in self.tied_comms.values():
                for attr in comm["weight_attr"]:
                    dist.broadcast(_attr(comm["module"], attr), src=min(comm["ranks"]), group=comm["group"])

    def allreduce_tied_weight_gradients(self) -> None:
        """Each tied weight's gradient summed over the stages that hold it (DeepSpeed's rule: the
        weight is one weight, used in several places)."""
        for comm in self.tied_comms.values():
            for attr in comm["weight_attr"]:
                weight = _attr(comm["module"], attr)
                if weight.grad is not None:
                    dist.all_reduce(weight.grad, group=comm["group"])

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(_attr(comm["module"], attr), comm["group"]) for comm in self.tied_comms.values()
                for attr in comm["weight_attr"]]

    # ----- what scripts and the engine read -----
    def topology(self) -> ProcessTopology:
        return self._topo

    def split_stages_over(self, tp: int) -> None:
        """Lay each stage's data-parallel ranks out as data x model (tensor parallel fastest, as
        PipeModelDataParallelTopology does): the engine's tensor_parallel.autotp_size inside a
        stage. A stage keeps its ranks, and each pipeline (every other axis fixed) its ranks, so
        the stages built and the tie groups stay as they are."""
        topo = self._topo
        if topo.get_dim("model") == tp:
            return
        if topo.get_dim("model") > 1:
            raise ConfigError(f"tensor_parallel.autotp_size {tp}: the PipelineModule's topology has a model axis of "
                              f"{topo.get_dim('model')}; give the same size in both")
        replicas = topo.get_dim("data")
        if replicas % tp:
            raise ConfigError(f"tensor_parallel.autotp_size {tp}: must divide each stage's {replicas} ranks "
                              f"({topo.world_size()} ranks over {self.num_stages} stages)")
        self._topo = PipeModelDataParallelTopology(num_pp=self.num_stages, num_mp=tp, num_dp=replicas // tp)

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank (stage) that holds the layer; with virtual stages, the rank of its chunk."""
        if not 0 <= layer_idx < len(self.layer_specs):
            raise RuntimeError(f"Layer {layer_idx} out of index range.")
        virtual = next(s for s in range(len(self.parts) - 1) if self.parts[s] <= layer_idx < self.parts[s + 1])
        return self.rank_of_virtual_stage(virtual)

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ConfigError(f"set_checkpoint_interval({interval}): expected 0 or more layers")
        self.activation_checkpoint_interval = interval

    def get_additional_losses(self) -> None:
        return None

    def compute_in(self, dtype: torch.dtype | None) -> None:
        """Run this stage's forward under autocast to `dtype` (the engine's bf16 or fp16), or as it is (None):
        the weights stay fp32, as our engine's data-parallel stages run bf16."""
        self._autocast_dtype = dtype

    # ----- forward -----
    def forward(self, *inputs: Any) -> Any:
        """This stage's layers in order. One input is passed on as it is (a tensor or a tuple); the
        schedule hands a stage what the one before sent as separate tensors, made one tuple again."""
        return self.run_layers(self.forward_funcs, *inputs)

    def run_layers(self, functions: list[Callable], *inputs: Any) -> Any:
        """`functions` (this rank's layers, or one chunk's) under the engine's autocast and the
        activation checkpoint interval."""
        dtype = self._autocast_dtype
        if dtype is None:
            return self._forward(functions, *inputs)
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        with torch.autocast(device.type, dtype=dtype):
            return self._forward(functions, *inputs)

    def _forward(self, functions: list[Callable], *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not self.training:
            for function in functions:
                x = function(x)
            return x
        for start in range(0, len(functions), interval):
            chunk = functions[start:start + interval]
            run = functools.partial(run_chunk, chunk)
            args = x if isinstance(x, tuple) else (x,)
            if self._checkpointable(chunk):
                x = (self.activation_checkpoint_func or functools.partial(torch_checkpoint, use_reentrant=False))(
                    run, *args)
            else:
                x = run(*args)
        return x

    def _checkpointable(self, chunk: list[Callable]) -> bool:
        """As DeepSpeed decides: the classes named in checkpointable_layers, else a chunk that holds
        parameters."""
        modules = [f for f in chunk if isinstance(f, nn.Module)]
        if self.checkpointable_layers is not None:
            return any(type(m).__name__ in self.checkpointable_layers for m in modules)
        return any(next(m.parameters(), None) is not None for m in modules)


def _device_of_group() -> torch.device:
    """The device the script's own process group runs on (nccl: this rank's GPU, by LOCAL_RANK as
    DeepSpeed's PipelineModule places itself); under a plan's census (torch's fake group), the meta
    device its layers were built on."""
    if dist.get_backend() == "fake":
        return torch.device("meta")
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
