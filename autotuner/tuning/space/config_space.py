"""The user's config as the search sees it: the base every experiment starts from, and the space
(stages, micro-batch sizes, gas, full mode's knobs per engine)."""

from __future__ import annotations

from typing import Any

from autotuner.core.engine_kind import Engine
from autotuner.config.models import DeepSpeedConfig
from autotuner.tuning.space.dimensions import (REGISTRY, dotted, finish_values, full_mode_values, lookup,
                                               settle_variants, variant_values)
from autotuner.tuning.space.search_space import SearchSpace


def base_config(config: DeepSpeedConfig) -> dict[str, Any]:
    """The user's config with every searchable value settled to a default; experiments set their own."""
    base = config.to_dict()
    zero = dict(base.get("zero_optimization", {}))
    for knob, value in list(zero.items()):
        if isinstance(value, list) and knob != "stage":
            zero[knob] = value[0]
    zero.pop("stage", None)
    base["zero_optimization"] = zero
    settle_variants(base)
    return base


def engine_dimensions(config: DeepSpeedConfig, engine: Engine, cuda: bool) -> dict[str, Any]:
    """The SearchSpace fields that follow the script's engine and device: full mode's knobs, the
    variants searched beside each stage and the finishing dimensions."""
    user = config.to_dict()
    return {"knob_values": full_mode_values(user, engine, cuda), "variants": variant_values(user, engine, cuda),
            "finishes": finish_values(user, engine, cuda)}


def search_space(config: DeepSpeedConfig, data_parallel_size: int, engine: Engine = Engine.OURS,
                 cuda: bool = False) -> SearchSpace:
    tuning = config.autotuning
    micro = config.train_micro_batch_size_per_gpu
    fixed_micro = tuple(micro) if isinstance(micro, list) else (micro,) if isinstance(micro, int) else ()
    gas = config.gradient_accumulation_steps
    exact = isinstance(config.train_batch_size, int)
    global_batch = config.train_batch_size if exact else tuning.max_train_batch_size
    return SearchSpace(
        stages=config.zero_optimization.stages,
        data_parallel_size=data_parallel_size,
        min_micro_batch_size=tuning.min_train_micro_batch_size_per_gpu,
        max_micro_batch_size=tuning.max_train_micro_batch_size_per_gpu,
        fixed_micro_batch_sizes=fixed_micro,
        fixed_gradient_accumulation_steps=gas if isinstance(gas, int) else None,
        global_batch_size=global_batch,
        global_batch_exact=exact,
        num_micro_batch_sizes=tuning.num_tuning_micro_batch_sizes,
        **engine_dimensions(config, engine, cuda),
    )


def untuned_dimension_lines(config: DeepSpeedConfig, space: SearchSpace, engine: Engine, cuda: bool) -> list[str]:
    """One line for each dimension the user asked to tune with "auto" (offload, say) that the space
    has no value to try for, saying why; every experiment then runs without it (the base config's
    neutral value). (Named for offload, its first case; any registered dimension is read.)"""
    searched = {k for variants in space.variants.values() for v in variants for k, _ in v}
    searched |= {k for finishes in space.finishes.values() for k in finishes}
    user = config.to_dict()
    lines = []
    for dim in REGISTRY.values():
        if dim.role == "knob" or lookup(user, dim.path) != (True, "auto") or dim.name in searched:
            continue
        if not cuda and dim.cuda_only:
            why = "this machine has no GPU, so parameters and optimizer state already live in host memory"
        elif engine in dim.untuned_reasons:
            why = dim.untuned_reasons[engine]
        else:
            offered = sorted(dim.values.get(engine, {}))
            why = f"it is searched at ZeRO {', '.join(map(str, offered))} only, and no such stage is searched here"
        lines.append(f"{dotted(dim)}: \"auto\" not tuned: {why}; every experiment runs without it")
    return lines
