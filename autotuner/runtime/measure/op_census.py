"""Every operator one forward and backward runs, with its FLOPs and the bytes it moves: what a
roofline costs on hardware that is not here (tuning/models/roofline.py; issue 80, part 3).

The census runs the model as it is, on any device; on the meta device nothing is allocated, so an
8B model's step is counted on a CPU in a second. Each aten operator is one record: its FLOPs by
torch's own formulas (torch.utils.flop_counter's registry, those FlopCounterMode sums), and the
bytes of its tensor inputs and outputs (views, which move nothing, count none). The records carry
the phase (forward or backward) and, where the caller names the model's repeated blocks, the block
whose forward ran the operator: activation checkpointing recomputes those.

Attention is counted as one fused kernel, as an accelerator runs it (flash attention): on the meta
device and on a CPU, torch's scaled_dot_product_attention falls back to the math path, whose
seq x seq matrices a GPU never writes out. So each call is run inside an autograd function that
records one forward and one backward record (the flash kernel's FLOPs: 4 b h s s' d forward, half
under a causal mask, 2.5 times that backward; bytes: q, k, v and the output, twice backward) and
hides the math path's operators from the census; it saves q, k, v and the output for its backward,
as the flash kernel does, so the saved-tensor probe counts them. Its gradients are zeros: a census step is for
counting, never for training (the plan exits after it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

BACKWARD_FLOPS_PER_FORWARD = 2.5  # flash attention's backward: dq, dk, dv and the recomputed scores

# Operators that return a view of their input (or nothing new): no bytes move.
_MOVES_NOTHING = frozenset({
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand", "aten.permute", "aten.slice",
    "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.reshape", "aten.alias", "aten.detach", "aten.as_strided",
    "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk", "aten.narrow", "aten.lift_fresh",
    "aten._reshape_alias", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.unflatten", "aten.flatten", "aten.view_as", "aten.expand_as",
})


@dataclass(frozen=True)
class OpRecord:
    """One operator's run: FLOPs, bytes read and written, phase ("forward" or "backward"), and the
    index of the block whose forward ran it (None outside the blocks, and in the backward)."""

    op: str
    flops: float
    bytes: float
    phase: str
    block: int | None = None

    @property
    def is_matmul(self) -> bool:
        return self.op in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")

    @property
    def is_attention(self) -> bool:
        return self.op == "attention"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value


class _Recorder(TorchDispatchMode):
    def __init__(self, census: "OpCensus"):
        super().__init__()
        self._census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        census = self._census
        if census.muted:
            return out
        packet = func._overloadpacket
        name = str(packet)
        flops = 0.0
        from torch.utils.flop_counter import flop_registry

        if packet in flop_registry:
            flops = float(flop_registry[packet](*tree_map(_shape, args), **tree_map(_shape, kwargs),
                                                out_val=tree_map(_shape, out)))
        moved = 0.0
        if name not in _MOVES_NOTHING:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            moved = float(sum(_nbytes(t) for t in tensors))
        census.add(name, flops, moved)
        return out


class _FusedAttention(torch.autograd.Function):
    """scaled_dot_product_attention as one recorded kernel each way (see the module's note)."""

    @staticmethod
    def forward(ctx, census, q, k, v, causal, kwargs):
        ctx.census = census
        batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
        flops = 4.0 * batch_heads * q.shape[-2] * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1.0)
        moved = float(_nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(q))
        ctx.costs = (flops, moved)
        census.muted = True
        try:
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        finally:
            census.muted = False
        census.add("attention", flops, moved)
        ctx.save_for_backward(q, k, v, out)  # what flash attention keeps (its row statistics aside)
        return out

    @staticmethod
    def backward(ctx, grad):
        flops, moved = ctx.costs
        ctx.census.add("attention", BACKWARD_FLOPS_PER_FORWARD * flops, 2 * moved)
        q, k, v, _ = ctx.saved_tensors
        return None, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None


class _Attention(TorchFunctionMode):
    def __init__(self, census: "OpCensus"):
        super().__init__()
        self._census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and not self._census.muted:
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            kwargs.update(zip(names, rest))
            causal = bool(kwargs.get("is_causal")) or kwargs.get("attn_mask") is not None
            return _FusedAttention.apply(self._census, q, k, v, causal, kwargs)
        return func(*args, **kwargs)


class OpCensus:
    """Records every operator the code inside `with census:` runs (its FLOPs and bytes), by phase,
    and by block where `blocks` are given; `census.phase = "backward"` before the backward."""

    def __init__(self, blocks: Iterable[nn.Module] = ()):
        self.records: list[OpRecord] = []
        self.phase = "forward"
        self.muted = False
        self._block: int | None = None
        self._handles = []
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._entering(index)))
            self._handles.append(block.register_forward_hook(self._leaving))
        self._modes = (_Attention(self), _Recorder(self))

    def _entering(self, index: int):
        def hook(module, args):
            self._block = index
        return hook

    def _leaving(self, module, args, output) -> None:
        self._block = None

    def add(self, op: str, flops: float, moved: float) -> None:
        block = self._block if self.phase == "forward" else None
        self.records.append(OpRecord(op, flops, moved, self.phase, block))

    def __enter__(self) -> "OpCensus":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def total_flops(self) -> float:
        return sum(r.flops for r in self.records)
