"""Which layers tensor parallelism splits, and how: the plan, as torch's DTensor styles.

The plan is the model's own where it has one (Hugging Face's `_tp_plan`, merged from the config's
`base_model_tp_plan` and the classes' plans), else DeepSpeed AutoTP's rule in training
(deepspeed/module_inject/auto_tp.py `tp_parser` and `_replace`, 0.19.8): in every block of a
ModuleList, the Linear just before a norm and those named `out_proj`, `o_proj` or `down_proj` (and
a few models' own names) split row-wise, the other Linears column-wise; MoE gates and low-rank
projections stay whole, and so do everything outside the blocks: embeddings, final norms and
`lm_head`. Both DeepSpeed layers are torch's styles exactly: a column layer's weight and bias
split on dim 0 (`ColwiseParallel`), a row layer's weight on dim 1 with the bias added after the
all-reduce (`RowwiseParallel`).

Where the split would be wrong, the plan is refused in one line rather than applied: a fused
query/key/value or gate/up projection (DeepSpeed splits those head-aware; torch's styles split
rows evenly, which would give rank 0 all of q and part of k), a head count the degree does not
divide (DeepSpeed splits uneven heads by whole heads; DTensor's even chunks cannot), a Hugging
Face style DeepSpeed's converter refuses too, and a model with nothing to split.

Nothing here touches a process group: `tp_plan(model, tp)` reads the model, `dtensor_styles`
gives what `parallelize_module` takes.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from autotuner.core.errors import UnsupportedError

COLWISE, ROWWISE, COLWISE_GATHERED = "colwise", "rowwise", "colwise_gathered"
# Hugging Face's styles as DeepSpeed 0.19.8's TPPlanConverter takes them (tp_plan_converter.py);
# None: the module stays whole (replicated). Any other style is refused, as DeepSpeed refuses it.
HF_STYLES: dict[str, str | None] = {
    "colwise": COLWISE,
    "colwise_rep": COLWISE_GATHERED,
    "colwise_gather_output": COLWISE_GATHERED,
    "rowwise": ROWWISE,
    "embedding_rowwise": None,  # DeepSpeed keeps the embedding whole unless its vocab-parallel head is on
    "replicated_with_grad_allreduce": None,
}
# AutoTP's row-wise names (tp_parser): anywhere in the Linear's name within its block.
ROW_NAMES = ("out_proj", "o_proj", "down_proj")
# ... and these, which DeepSpeed takes as row-wise only in the model families named beside them.
FAMILY_ROW_NAMES = (("attention.dense", "gptneox"), ("self_attention.dense", "falcon"), ("self_attn.dense", "phi"),
                    ("w2", "mixtral"), ("self_attention.dense", "chatglm"), ("dense_4h_to_h", "chatglm"))
NORM_NAMES = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
FUSED_NAMES = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn", "gate_up_proj")
# Attributes of a split module's parents that count heads or widths (DeepSpeed's update_mp_params).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads",
                   "n_head", "all_head_size", "embed_dim", "hidden_size", "num_attention_heads_per_partition",
                   "hidden_size_per_partition")


@dataclass(frozen=True)
class TensorParallelPlan:
    """Each split Linear's name (from the model's root) with its style, in the model's order, and
    where the plan came from, for the line that says so."""

    styles: tuple[tuple[str, str], ...]
    source: str

    @property
    def split(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.styles)


def tp_plan(model: nn.Module, tp_size: int) -> TensorParallelPlan:
    """The plan for `model` at degree `tp_size`, checked (see the module's docstring)."""
    hf = _hugging_face_plan(model)
    plan = (TensorParallelPlan(hf, "the model's own tensor-parallel plan (Hugging Face's _tp_plan)")
            if hf is not None else TensorParallelPlan(_autotp_rule(model), "DeepSpeed AutoTP's rule"))
    if not any(style != COLWISE_GATHERED for _, style in plan.styles):
        raise UnsupportedError(f"tensor_parallel.autotp_size {tp_size}: {type(model).__name__} has no Linear layer "
                               f"in a block of a ModuleList for {plan.source} to split; train it with autotp_size 1")
    modules = dict(model.named_modules())
    for name, _ in plan.styles:
        linear = modules[name]
        if not isinstance(linear, nn.Linear):
            raise UnsupportedError(f"tensor_parallel.autotp_size {tp_size}: {name} is a {type(linear).__name__}, "
                                   "and only nn.Linear layers are split here")
        if any(fused in name for fused in FUSED_NAMES):
            raise UnsupportedError(f"tensor_parallel.autotp_size {tp_size}: {name} is a fused projection, which "
                                   "DeepSpeed splits head by head and an even split would mix up; not supported "
                                   "on this engine yet")
        # A column layer splits its outputs, a row layer its inputs.
        width = linear.in_features if dict(plan.styles)[name] == ROWWISE else linear.out_features
        if width % tp_size:
            raise UnsupportedError(f"tensor_parallel.autotp_size {tp_size}: {name} has {width} features to split, "
                                   f"which {tp_size} does not divide")
    for owner, attribute, value in head_counts(model, plan):
        if value % tp_size:
            raise UnsupportedError(f"tensor_parallel.autotp_size {tp_size}: {owner or type(model).__name__}.{attribute} "
                                   f"is {value}, which {tp_size} does not divide (each rank takes whole heads)")
    return plan


def plan_styles(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """The plan's styles for `model` as it stands (no degree's divisibility checked), or () where
    it has nothing this engine would split: what a profile at degree 1 measures a degree by."""
    try:
        return tp_plan(model, 1).styles
    except UnsupportedError:
        return ()


def _hugging_face_plan(model: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """The model's merged Hugging Face plan, expanded over its modules; None without one."""
    rules: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base = getattr(model, "base_model_prefix", "")
    for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        rules.setdefault(f"{base}.{key}" if base and hasattr(model, base) else key, style)
    if not rules:
        return None
    for pattern, style in rules.items():
        if style not in HF_STYLES:
            raise UnsupportedError(f"tensor_parallel: the model's tensor-parallel plan gives {pattern!r} the style "
                                   f"{style!r}, which DeepSpeed's AutoTP training does not take either; it takes "
                                   f"{', '.join(sorted(HF_STYLES))}")
    styles = []
    for name, module in model.named_modules():
        matched = [style for pattern, style in rules.items() if _matches(name, pattern)]
        if matched and HF_STYLES[matched[0]] is not None and isinstance(module, nn.Linear):
            styles.append((name, HF_STYLES[matched[0]]))
    if _tied_head(model) and any(name.endswith("lm_head") for name, _ in styles):
        # A head tied to the embedding stays whole with it (DeepSpeed's gathered-column fallback).
        styles = [(name, style) for name, style in styles if not name.endswith("lm_head")]
    return tuple(styles)


def _matches(name: str, pattern: str) -> bool:
    """Hugging Face's rule: `*` stands for one name between dots."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


def _tied_head(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return (isinstance(head, nn.Linear) and isinstance(embeddings, nn.Embedding)
            and head.weight is embeddings.weight)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every entry of every ModuleList, by name: the blocks AutoTP splits inside (in a PipelineModule,
    the layers its stage built, each one a block)."""
    found = []
    if hasattr(model, "forward_funcs") and hasattr(model, "layer_specs"):  # a PipelineModule: its stage's layers
        return [(name, module) for name, module in model.named_children() if name.isdigit()]
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            found += [(f"{name}.{index}" if name else str(index), block) for index, block in enumerate(module)]
    return found


def _layer_list(module: nn.Module, prefix: str = "") -> list[str]:
    """AutoTP's walk of a block: each Linear's name within it and "ln" for each norm, in order."""
    out = []
    for key, child in module._modules.items():
        if child is None:
            continue
        name = f"{prefix}{key}"
        if isinstance(child, nn.Linear):
            out.append(name)
        elif isinstance(child, nn.LayerNorm) or key in NORM_NAMES:
            out.append("ln")
        else:
            out += _layer_list(child, f"{name}.")
    return out


def _autotp_rule(model: nn.Module) -> tuple[tuple[str, str], ...]:
    family = type(model).__name__.lower()
    styles = []
    for block_name, block in _blocks(model):
        layers = _layer_list(block)
        # DeepSpeed's own indexing: a norm that opens the block marks the block's last layer
        # (layers[-1]), so a pre-norm block's output projection splits row-wise.
        rows = {layers[i - 1] for i, layer in enumerate(layers) if layer == "ln" and layers[i - 1] != "ln"}
        for layer in layers:
            if layer == "ln" or _left_whole(layer):
                continue
            row = (layer in rows or any(n in layer for n in ROW_NAMES)
                   or any(n in layer and f in family for n, f in FAMILY_ROW_NAMES))
            styles.append((f"{block_name}.{layer}", ROWWISE if row else COLWISE))
    return tuple(styles)


def _left_whole(layer: str) -> bool:
    """MoE gates and low-rank projections stay whole (AutoTP's `_replace`)."""
    return (layer in ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")
            or "q_a_proj" in layer or "kv_a_proj_with_mqa" in layer)


def head_counts(model: nn.Module, plan: TensorParallelPlan) -> list[tuple[str, str, int]]:
    """(module name, attribute, value) of every head-counting attribute on a split Linear's parents,
    and the config's head counts: what each rank must hold a whole share of."""
    parents = {name.rpartition(".")[0] for name in plan.split}
    modules = dict(model.named_modules())
    found = []
    for name in sorted(parents):
        module = modules.get(name)
        for attribute in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head"):
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((name, attribute, value))
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(("config", attribute, value))
    return found


def divide_head_attributes(model: nn.Module, plan: TensorParallelPlan, tp_size: int) -> list[str]:
    """Divide the head and width counts on the split Linears' parents by the degree, as DeepSpeed's
    update_mp_params does, so code that views activations by them sees this rank's share; the
    config is shared with the whole model and left alone. Returns what was divided."""
    modules = dict(model.named_modules())
    divided = []
    for name in sorted({name.rpartition(".")[0] for name in plan.split}):
        module = modules.get(name)
        if module is None or isinstance(module, nn.Linear):
            continue
        for attribute in HEAD_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp_size == 0:
                setattr(module, attribute, value // tp_size)
                divided.append(f"{name}.{attribute}")
    return divided


def dtensor_styles(plan: TensorParallelPlan) -> dict[str, Any]:
    """The plan as `parallelize_module` takes it. Outputs stay local tensors, so a block's code that
    views them by `-1` heads sees this rank's share; a gathered column layer returns the whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {COLWISE: lambda: ColwiseParallel(), ROWWISE: lambda: RowwiseParallel(),
            COLWISE_GATHERED: lambda: ColwiseParallel(output_layouts=Replicate())}
    return {name: make[style]() for name, style in plan.styles}
