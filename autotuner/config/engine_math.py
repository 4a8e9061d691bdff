"""DeepSpeed config keys whose non-default values change the training math. DeepSpeed's engine
honours them; ours would train differently, so it refuses them in one line rather than ignore them."""

from __future__ import annotations

from autotuner.config.models import DeepSpeedConfig
from autotuner.errors import ConfigError


def refuse_other_math(config: DeepSpeedConfig, source: str) -> None:
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
