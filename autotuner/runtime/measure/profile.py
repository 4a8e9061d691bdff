"""Measurements the autotuner asks of a rank: FLOPs per micro-step and activation bytes.

Activation bytes are the tensors autograd saves for backward (parameters excluded),
counted once per storage with saved-tensor hooks. That works the same on CPU and
GPU and does not depend on allocator noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autotuner.core.engine_kind import Engine
from autotuner.core.boundary import ModelInfo, write_record
from autotuner.core.probe_records import CollectiveTiming, SplitLayerTiming


class FlopProbe:
    """Counts FLOPs of one forward + backward with torch's FlopCounterMode."""

    def __init__(self) -> None:
        self.total: float | None = None
        self._mode = None

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self.total = float(self._mode.get_total_flops()) or None
        self._mode = None


@dataclass(frozen=True)
class SplitRegions:
    """At degree 1, what a tensor-parallel plan would split (ActivationProbe.watch_split_regions):
    the parameters it splits (counted whole), the bytes the first micro-step saved inside its
    split regions, and the share of that forward's FLOPs run there (torch's FlopCounterMode; a
    matmul's backward costs twice its forward, so the share holds for the backward too)."""

    params: int = 0
    saved_bytes: int = 0
    flop_share: float = 0.0
    row_layers: int = 0  # row-wise layers the forward ran: one all-reduce each at degree k, and one back
    row_output_bytes: int = 0  # their outputs' bytes on this micro-batch: what those all-reduces carry
    col_layers: int = 0  # column-wise layers the forward ran: each all-reduces its input's gradient at degree k


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    # A DTensor (tensor parallelism) is a wrapper without storage: its local tensor holds the bytes.
    tensor = _local(tensor)
    try:
        storage = tensor.untyped_storage()
        if tensor.device.type == "meta":  # every meta storage's data_ptr is 0: tell them apart by their StorageImpl
            return ("meta", storage._cdata)
        return (str(tensor.device), storage.data_ptr())
    except (RuntimeError, NotImplementedError):
        return (str(tensor.device), id(tensor))


def _storage_bytes(tensor: torch.Tensor) -> int:
    tensor = _local(tensor)  # this rank's shard of a DTensor, not its global size
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


# Autograd nodes of the ops whose outputs selective checkpointing keeps (training/activation_checkpointing.py),
# and of the views and reshapes that may sit between such an output and the op that saves it
# (nn.Linear on 3-D input is a view of an mm; Hugging Face's Conv1D views an addmm).
_MATMUL_NODES = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0",
                           "ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductFlashAttentionBackward0",
                           "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0"})
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AsStridedBackward0",
                         "TBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0"})


def _made_by_a_matmul(tensor: torch.Tensor) -> bool:
    node = tensor.grad_fn
    for _ in range(4):
        if node is None:
            return False
        name = type(node).__name__
        if name in _MATMUL_NODES:
            return True
        if name not in _VIEW_NODES or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


class ActivationProbe:
    """Bytes of tensors saved for backward during one forward, excluding parameter storage.

    Given the model's repeated blocks (run with no activation checkpointing), it also says what
    each checkpointing policy would keep, from the same forward: the bytes saved outside the
    blocks, each block's input, each block's saved bytes, and among them the outputs of matmuls
    and attention kernels (what "selective" keeps), told by the autograd node that made them. Under "full" a block keeps its input and,
    in its backward, recomputes its own activations one block at a time; under "selective" it
    keeps its matmul outputs too and recomputes the rest one block at a time."""

    def __init__(self, parameters: list[torch.Tensor], blocks: list[nn.Module] | None = None,
                 model: nn.Module | None = None):
        self._param_keys = {_storage_key(_local(p)) for p in parameters}
        self._model = model
        self.sequence_length = 0  # of the model's first input (the workload signature's), 0 if none
        self._seen: set[tuple[str, int]] = set()
        self.bytes_saved = 0
        self._hooks = None
        self._blocks = list(blocks or [])
        self._handles: list = []
        self._current: int | None = None  # the block whose forward is running
        self._outside = 0
        self._inside = [0] * len(self._blocks)
        self._matmul_inside = [0] * len(self._blocks)
        self._inputs = [0] * len(self._blocks)
        # Under a tensor-parallel plan not applied (degree 1): the bytes saved inside its split
        # regions, each from a column-wise Linear's output to the next row-wise Linear's input
        # (what a degree k would divide by k), and the parameters it would split.
        self._split_styles: dict[nn.Module, str] = {}
        self._in_split = False
        self.split_bytes = 0
        self.splittable_params = 0
        self._flops = None  # a FlopCounterMode over the probed forward, where a plan is watched
        self._flop_mark: float | None = None  # the count where the open split region began
        self._split_flops = 0.0
        self._forward_flops = 0.0
        self._row_layers = 0
        self._row_output_bytes = 0
        self._col_layers = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._param_keys and key not in self._seen:
            self._seen.add(key)
            size = _storage_bytes(tensor)
            self.bytes_saved += size
            if self._in_split:
                self.split_bytes += size
            if self._current is None:
                self._outside += size
            else:
                self._inside[self._current] += size
                if _made_by_a_matmul(tensor):
                    self._matmul_inside[self._current] += size
        # Detached: autograd needs only the same data back. The tensor itself, saved as one of its
        # node's outputs, would hold that node (and the micro-batch's graph) in a reference cycle
        # till the garbage collector runs: measured on a pipeline's first stage, one more
        # micro-batch's activations in the profile launch's peak (+48 MiB at micro-batch 8).
        return tensor.detach()

    def _watch_blocks(self) -> None:
        def entering(index: int):
            def hook(module, args):
                self._current = index
                self._inputs[index] += sum(_storage_bytes(a) for a in args if isinstance(a, torch.Tensor))
            return hook

        def leaving(module, args, output):
            self._current = None

        for index, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(entering(index)))
            self._handles.append(block.register_forward_hook(leaving))

    def watch_split_regions(self, model: nn.Module, styles: tuple[tuple[str, str], ...]) -> None:
        """Count what a tensor-parallel plan (tp_plan.py: (Linear name, "colwise"|"rowwise"|...))
        would split: a column-wise layer's input is the replicated hidden state, its output and
        what is saved from there to the next row-wise layer's input is split."""
        modules = dict(model.named_modules())
        for name, style in styles:
            if name in modules and style in ("colwise", "rowwise"):
                linear = modules[name]
                self._split_styles[linear] = style
                # A column layer splits its weight and bias, a row layer its weight (its bias is added whole).
                self.splittable_params += linear.weight.numel() + (
                    linear.bias.numel() if style == "colwise" and linear.bias is not None else 0)

    def _watch_split_regions(self) -> None:
        def before(module, args):
            if self._split_styles[module] == "colwise":
                self._in_split = False
                if self._flop_mark is None:  # the column layer's own matmul splits too
                    self._flop_mark = self._counted_flops()

        def after(module, args, output):
            self._in_split = self._split_styles[module] == "colwise"
            if self._in_split:
                self._col_layers += 1
            if self._split_styles[module] == "rowwise":
                self._close_flop_region()
                self._row_layers += 1
                if isinstance(output, torch.Tensor):
                    self._row_output_bytes += output.numel() * output.element_size()

        for module in self._split_styles:
            self._handles.append(module.register_forward_pre_hook(before))
            self._handles.append(module.register_forward_hook(after))

    def _counted_flops(self) -> float:
        return float(self._flops.get_total_flops()) if self._flops is not None else 0.0

    def _close_flop_region(self) -> None:
        if self._flop_mark is not None:
            self._split_flops += self._counted_flops() - self._flop_mark
            self._flop_mark = None

    def split_regions(self) -> SplitRegions:
        share = self._split_flops / self._forward_flops if self._forward_flops > 0 else 0.0
        return SplitRegions(self.splittable_params, self.split_bytes, min(1.0, share), self._row_layers,
                            self._row_output_bytes, self._col_layers)

    def _see_input(self, module, args, kwargs) -> None:
        if not self.sequence_length:
            self.sequence_length = sequence_length_of([*args, *kwargs.values()])

    def start(self) -> None:
        self._watch_blocks()
        self._watch_split_regions()
        if self._split_styles:
            from torch.utils.flop_counter import FlopCounterMode

            self._flops = FlopCounterMode(display=False)
            self._flops.__enter__()
        if self._model is not None:
            self._handles.append(self._model.register_forward_pre_hook(self._see_input, with_kwargs=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        if self._flops is not None:
            # A column layer with no row layer after it leaves its region open: counted to the end,
            # the side that credits the split with more.
            self._close_flop_region()
            self._forward_flops = self._counted_flops()
            self._flops.__exit__(None, None, None)
            self._flops = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._in_split = False

    def held_by_policy(self) -> dict[str, int]:
        """Bytes each checkpointing policy holds for backward once the forward is done, from one
        forward without checkpointing; empty without blocks."""
        if not self._blocks or not any(self._inside):
            return {}
        kept = self._outside + sum(self._inputs)
        return {"none": self.bytes_saved, "full": kept, "selective": kept + sum(self._matmul_inside)}

    def bytes_by_policy(self) -> dict[str, int]:
        """The peak each policy reaches in backward: what it holds, plus one block's recomputed
        activations (all of them under "full", all but the matmul outputs under "selective")."""
        held = self.held_by_policy()
        if not held:
            return {}
        recomputed = [inside - matmul for inside, matmul in zip(self._inside, self._matmul_inside)]
        return {"none": held["none"], "full": held["full"] + max(self._inside),
                "selective": held["selective"] + max(recomputed)}


    def saved_by_block(self) -> tuple[tuple[int, ...], int]:
        """The bytes saved inside each block, in order, and outside every block."""
        return tuple(self._inside), self._outside


def sequence_length_of(inputs: list) -> int:
    """Dim 1 of a model's first tensor input where that is a sequence: token ids (batch, positions)
    or embeddings (batch, positions, features). 0 for anything else, such as an MLP's
    (batch, features)."""
    tensor = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if tensor is None or tensor.dim() < 2 or (tensor.dim() == 2 and tensor.is_floating_point()):
        return 0
    return int(tensor.shape[1])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(all, trainable) element counts of the full, unsharded model."""
    total = trainable = 0
    for param in module.parameters():
        numel = param.numel()  # a DTensor reports its global size
        total += numel
        if param.requires_grad:
            trainable += numel
    return total, trainable


def device_memory_bytes(device: torch.device) -> int | None:
    """What this rank's caching allocator can hold at most: the GPU's free memory plus what the
    allocator already reserved, read with cudaMemGetInfo once the CUDA context, NCCL and cuBLAS
    have taken theirs (so not the card's total, which no allocation can reach). The budget is
    compared with allocator peaks, so memory outside the allocator must not count in it.
    None on CPU (the tuner uses host RAM there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def write_model_info(
    path: str | Path,
    *,
    zero_stage_module: nn.Module,
    activation_bytes_per_rank: list[int],
    optimizer_state_bytes: int,
    micro_batch_size: int,
    peak_memory_bytes_per_rank: list[int],
    peak_reserved_bytes_per_rank: list[int] | None,
    phase_peak_bytes: tuple[int, int] | None,
    num_shard_units: int,
    device_memory_bytes: int | None,
    zero_stage: int,
    precision: str,
    world_size: int,
    engines_in_process: int = 1,
    backend: str | None = None,
    collective_timings: tuple[CollectiveTiming, ...] = (),
    parameter_counts: tuple[int, int] | None = None,
    engine: Engine = Engine.OURS,
    activation_bytes_by_policy: dict[str, int] | None = None,
    sequence_length: int = 0,
    tensor_parallel: int = 1,
    split_num_params: int = 0,
    splittable_num_params: int = 0,
    split_activation_bytes: int = 0,
    split_flop_share: float = 0.0,
    split_row_layers: int = 0,
    split_row_output_bytes: int = 0,
    split_col_layers: int = 0,
    split_layer_timings: tuple[SplitLayerTiming, ...] = (),
    measured_model: str = "",
    pipeline: dict[str, Any] | None = None,
) -> ModelInfo:
    total, trainable = parameter_counts or count_parameters(zero_stage_module)
    from autotuner.runtime.measure.model_family import device_name, model_family

    info = ModelInfo(
        num_params=total,
        trainable_num_params=trainable,
        activation_bytes_per_rank=tuple(activation_bytes_per_rank),
        activation_bytes=max(activation_bytes_per_rank),
        optimizer_state_bytes_per_param=optimizer_state_bytes / max(1, trainable),
        micro_batch_size=micro_batch_size,
        peak_memory_bytes_per_rank=tuple(peak_memory_bytes_per_rank),
        peak_memory_bytes=max(peak_memory_bytes_per_rank),
        peak_reserved_bytes=max(peak_reserved_bytes_per_rank) if peak_reserved_bytes_per_rank else None,
        # CUDA only, in the steady state (step 2), the largest over ranks: allocator peaks of
        # forward+backward and of the optimizer step, which the memory model fits apart.
        forward_backward_peak_bytes=phase_peak_bytes[0] if phase_peak_bytes else None,
        optimizer_step_peak_bytes=phase_peak_bytes[1] if phase_peak_bytes else None,
        num_shard_units=num_shard_units,
        device_memory_bytes=device_memory_bytes,
        zero_stage=zero_stage,
        precision=precision,
        world_size=world_size,
        engines_in_process=engines_in_process,
        backend=backend,
        collective_timings=tuple(collective_timings),
        engine=engine,
        activation_bytes_by_policy=tuple(sorted((activation_bytes_by_policy or {}).items())),
        model_family=model_family(zero_stage_module),
        device_name=device_name(),
        sequence_length=sequence_length,
        tensor_parallel=tensor_parallel,
        split_num_params=split_num_params,
        splittable_num_params=splittable_num_params,
        split_activation_bytes=split_activation_bytes,
        split_flop_share=split_flop_share,
        split_row_layers=split_row_layers,
        split_row_output_bytes=split_row_output_bytes,
        split_col_layers=split_col_layers,
        split_layer_timings=tuple(split_layer_timings),
        measured_model=measured_model,
        **(pipeline or {}),  # a pipeline's per-stage fields (rank_measurement.py `pipeline_fields`)
    )
    write_record(path, info)
    return info
