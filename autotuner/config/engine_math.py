"""DeepSpeed config keys whose non-default values change the training math. DeepSpeed's engine
honours them; ours would train differently, so it refuses them in one line rather than ignore them."""

from __future__ import annotations

from autotuner.config.models import DeepSpeedConfig
from autotuner.config.tensor_parallel import refuse_unsupported as refuse_unsupported_tp
from autotuner.core.errors import ConfigError


# Sections DeepSpeed's engine acts on when enabled, changing what the model is fed or runs; ours does
# not carry them. Enabled, they would train differently here: refused at initialize, before any step.
_FEATURES = {
    "data_efficiency": "DeepSpeed's data efficiency library (curriculum sampling, random-LTD)",
}


def _enabled(section: object) -> bool:
    """"enabled": true, and where sub-sections carry their own switch (data_efficiency nests them),
    one of those enabled too; an explicit false turns everything below it off."""
    if not isinstance(section, dict) or section.get("enabled") is False:
        return False
    switched = [value for value in section.values() if isinstance(value, dict) and "enabled" in value]
    if switched:
        return any(_enabled(value) for value in switched)
    return section.get("enabled") is True


def refuse_other_math(config: DeepSpeedConfig, source: str) -> None:
    for key, what in _FEATURES.items():
        if _enabled(config.set_aside.get(key)):
            raise ConfigError(f"{source}: {key} is enabled: {what} is not carried by autotuner's engine, so the run "
                              "would train differently from DeepSpeed; disable the section, or train on DeepSpeed's "
                              "engine (import deepspeed, or --engine deepspeed)")
    refuse_unsupported_tp(config.tensor_parallel, source)
    sequence_parallel = config.set_aside.get("sequence_parallel_size", 1)
    if isinstance(sequence_parallel, int) and not isinstance(sequence_parallel, bool) and sequence_parallel > 1:
        raise ConfigError(f"{source}: sequence_parallel_size {sequence_parallel}: DeepSpeed's engine splits each "
                          "sequence over that many ranks (and divides the data-parallel size by it); autotuner's "
                          "engine trains every rank data parallel; remove it, or train on DeepSpeed's engine")
    if not config.managed_gradient_accumulation:
        raise ConfigError(f"{source}: managed_gradient_accumulation false (every step() is an optimizer step) is not "
                          "supported by autotuner's engine; remove it and set gradient_accumulation_steps instead")
    if config.gradient_allreduce_op != "mean":
        raise ConfigError(f"{source}: gradient_allreduce_op {config.gradient_allreduce_op!r}: autotuner's engine "
                          "averages gradients over ranks (\"mean\"); remove the key, or scale the loss yourself")
    if config.torch_autocast.get("enabled"):
        raise ConfigError(f"{source}: torch_autocast.enabled: autotuner's engine does mixed precision through "
                          "bf16.enabled / fp16.enabled (torch.autocast at stages 0-1, FSDP2's MixedPrecisionPolicy "
                          "at 2-3); set one of those instead")
