"""Key checking before validation: typos are refused with a suggestion, and
known DeepSpeed keys we do not act on are set aside with one warning."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Mapping

from pydantic import AliasChoices, BaseModel

from autotuner.core.errors import ConfigError

# DeepSpeed keys that are real but have no effect in our engine, by section.
# "" is the top level. They are accepted so a user's existing file still loads.
KNOWN_UNUSED_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            "aio", "checkpoint", "comms_logger",
            "data_efficiency", "data_types", "dataloader_drop_last", "disable_allgather", "dump_state",
            "memory_breakdown",
            "monitor_config", "weight_quantization", "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer", "train_batch_size_per_gpu_at_fp16", "hybrid_engine",
            "comet", "log_level", "disable_python_gc",
            "use_data_before_expert_parallelism", "expert_parallel", "seq_parallel_communication_data_type",
            "sequence_parallel_size",
        }
    ),
    "zero_optimization": frozenset(
        {
            "allgather_partitions", "reduce_scatter", "round_robin_gradients", "load_from_fp32_weights",
            "elastic_checkpoint", "ignore_unused_parameters", "sub_group_size",
            "cpu_offload_params", "cpu_offload_use_pin_memory",
            "stage3_max_reuse_distance", "max_reuse_distance", "stage3_model_persistence_threshold",
            "model_persistence_threshold", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
            "zero_quantized_nontrainable_weights",
            "memory_efficient_linear", "use_multi_rank_bucket_allreduce", "pipeline_loading_checkpoint",
            "override_module_apply", "log_trace_cache_warnings", "module_granularity_threshold",
            "use_all_reduce_for_fetch_params", "legacy_stage1",
        }
    ),
    "zero_optimization.offload_optimizer": frozenset(
        {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init", "ratio"}
    ),
    "zero_optimization.offload_param": frozenset({"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"}),
    # DeepSpeed's own: read only by deepspeed.checkpointing.configure (autotuner/deepspeed_paths/checkpointing.py).
    "activation_checkpointing": frozenset({"partition_activations", "contiguous_memory_optimization",
                                           "cpu_checkpointing", "number_checkpoints",
                                           "synchronize_checkpoint_boundary", "profile"}),
    # DeepSpeed 0.16+'s DeepCompile keys (its own compiler passes for its engine).
    "compile": frozenset({"deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold",
                          "offload_activation", "offload_activation_pin_memory", "offload_opt_states",
                          "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
                          "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                          "keep_int_input_tensors", "keep_all_input_tensors", "passes"}),
    "fp16": frozenset({"fp16_master_weights_and_grads"}),
    "bf16": frozenset({"immediate_grad_update"}),
    "autotuning": frozenset({"min_train_batch_size"}),
}


# What runs instead, where a set-aside key names something a script would otherwise expect.
UNUSED_KEY_NOTES: dict[str, str] = {
    "hybrid_engine": "hybrid_engine: generation runs Hugging Face's generate on the training module, without "
                     "DeepSpeed's inference kernels or its inference tensor parallelism",
}


def field_names(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
        if isinstance(info.validation_alias, AliasChoices):
            names.update(c for c in info.validation_alias.choices if isinstance(c, str))
    return names


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside `Model`, `Model | None` or `Optional[Model]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_model(arg)
        if found is not None:
            return found
    return None


# Keys DeepSpeed 0.19.8 removed, and refuses in any config that holds them (enabled or not,
# runtime/config.py _reject_removed_config_keys): what each did, and what to do instead.
REMOVED_KEYS: dict[str, str] = {
    "nebula": "Nebula checkpointing",
    "compression_training": "the compression library",
    "amp": "NVIDIA Apex AMP; use fp16 or bf16",
    "quantize_training": "Mixture-of-Quantization",
    "sparse_gradients": "sparse embedding-gradient compression",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization",
    "sparse_attention": "Sparse Attention",
    "elasticity": "elastic training; set the batch sizes directly",
    "graph_harvesting": "graph harvesting",
    "curriculum_learning": "the legacy top-level curriculum; use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping",
    "zero_optimization.mics_shard_size": "MiCS sharding",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS sharding",
    "zero_optimization.zeropp_loco_param": "LoCo ZeRO++",
}


def check_keys(raw: dict[str, Any], model: type[BaseModel], source: str, path: str = "",
               sections: Mapping[str, type[BaseModel]] | None = None) -> tuple[dict, list[str]]:
    """Return a copy of `raw` without known-unused keys, and their dotted paths. `sections` are
    more keys `raw` may hold beside `model`'s own, each checked against its model (a plugin's
    dimension's section, config/sections.py).

    Raises ConfigError on the first unknown key, with the closest known key, and on a key
    DeepSpeed 0.19.8 removed (it refuses such a file too).
    """
    extra = dict(sections or {})
    known = field_names(model) | set(extra)
    unused_here = KNOWN_UNUSED_KEYS.get(path, frozenset())
    kept: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        dotted = f"{path}.{key}" if path else key
        if dotted in REMOVED_KEYS:
            raise ConfigError(f"{source}: {dotted}: removed from DeepSpeed ({REMOVED_KEYS[dotted]}), and DeepSpeed "
                              "0.19.8 refuses a config that holds it, enabled or not; remove it")
        if key in known:
            field = model.model_fields.get(key)
            sub = extra.get(key) or (section_model(field.annotation) if field is not None else None)  # None: an alias
            if sub is not None and isinstance(value, dict):
                value, sub_ignored = check_keys(value, sub, source, dotted)
                ignored.extend(sub_ignored)
            kept[key] = value
        elif key in unused_here:
            ignored.append(dotted)
        else:
            close = difflib.get_close_matches(key, sorted(known | unused_here), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; allowed keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{source}: unknown key '{dotted}'{hint}")
    return kept, ignored
