"""Hugging Face's "auto" values: config keys the Trainer fills in from its own arguments before
DeepSpeed reads the config (transformers' HfTrainerDeepSpeedConfig.trainer_config_process and
trainer_config_finalize). They load; on DeepSpeed's engine they reach the script unchanged; our
engine has no Trainer to fill them, so it refuses them in one line that says what to set.

The batch keys are not here: their "auto" is the tuner's to settle (config/batch.py), and
bf16.enabled "auto" keeps our meaning on our engine (bf16 where the device supports it).
"""

from __future__ import annotations

from typing import Any

from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError

# Dotted key -> what to set on our engine instead, with an example.
TRAINER_FILLED: dict[str, str] = {
    "gradient_clipping": "a number, e.g. 1.0 (0 disables clipping)",
    "fp16.enabled": "true or false",
    "optimizer.params.lr": "a number, e.g. 1e-4",
    "optimizer.params.betas": "two numbers, e.g. [0.9, 0.999]",
    "optimizer.params.eps": "a number, e.g. 1e-8",
    "optimizer.params.weight_decay": "a number, e.g. 0.0",
    "scheduler.params.warmup_min_lr": "a number, e.g. 0",
    "scheduler.params.warmup_max_lr": "a number, e.g. 1e-4",
    "scheduler.params.warmup_num_steps": "a step count, e.g. 100",
    "scheduler.params.total_num_steps": "a step count, e.g. 1000",
    "zero_optimization.reduce_bucket_size": "elements, e.g. 5e8",
    "zero_optimization.stage3_prefetch_bucket_size": "elements, e.g. 5e7",
    "zero_optimization.stage3_param_persistence_threshold": "elements, e.g. 1e5",
}


def _value(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def trainer_auto_keys(config: DeepSpeedConfig) -> list[str]:
    """The keys, in TRAINER_FILLED's order, whose value is still "auto"."""
    data = config.to_dict()
    return [key for key in TRAINER_FILLED if _value(data, key) == "auto"]


def refuse_trainer_autos(config: DeepSpeedConfig, source: str, why: str = "") -> None:
    """Our engine cannot train with values only Hugging Face's Trainer fills in: one line naming
    each key and what to set, and `why` the script is taken to train on ours where that was read
    from it (a clause: "train.py imports autotuner (line 2) and not deepspeed, ...")."""
    keys = trainer_auto_keys(config)
    if not keys:
        return
    listed = ", ".join(keys)
    verb, what = ("is", "a value") if len(keys) == 1 else ("are", "values")
    settings = "; ".join(f"{key} to {TRAINER_FILLED[key]}" for key in keys)
    because = f", but {why}" if why else ""
    raise ConfigError(f"{source}: {listed} {verb} \"auto\" ({what} Hugging Face's Trainer fills in){because}; on "
                      f"autotuner's engine set {settings}")


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def refuse_auto_batch(config: DeepSpeedConfig, source: str) -> None:
    """A batch size left "auto" when training: the tuner or the Trainer settles it, and neither ran.
    DeepSpeed's engine refuses it too; filled in here, "auto" accumulation trained as 1."""
    keys = [key for key in BATCH_KEYS if getattr(config, key) == "auto"]
    if keys:
        verb = "is" if len(keys) == 1 else "are"
        raise ConfigError(f"{source}: {', '.join(keys)} {verb} \"auto\", which the autotuner (launcher --autotuning "
                          "tune|run) or Hugging Face's Trainer fills in, and neither ran before this engine; give "
                          "a number to train")


# What a check before launch puts where the Trainer will put its own value (never trained with).
_STAND_INS: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                              "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1,
                              "total_num_steps": 2}


def with_stand_ins(params: dict[str, Any]) -> dict[str, Any]:
    """Optimizer or scheduler params with each "auto" the Trainer fills replaced by a plain value
    of the right kind, so the rest can still be checked before a launch."""
    return {key: _STAND_INS.get(key, value) if value == "auto" else value for key, value in params.items()}


def passed_through_note(config: DeepSpeedConfig, source: str) -> str | None:
    """What the tuner does with "auto" values on DeepSpeed's engine, as one line (None: none)."""
    keys = trainer_auto_keys(config)
    if config.bf16.enabled == "auto":
        keys.insert(keys.index("fp16.enabled") + 1 if "fp16.enabled" in keys else 0, "bf16.enabled")
    if not keys:
        return None
    line = (f"{source}: {', '.join(keys)} left \"auto\" for Hugging Face's Trainer (or accelerate) to fill in "
            "(passed to the script unchanged)")
    if any(key.endswith("16.enabled") for key in keys):
        line += "; the profile launch measures the precision it picks"
    if any(key.startswith("zero_optimization.") for key in keys):
        line += "; the memory model costs \"auto\" ZeRO buckets at DeepSpeed's defaults (no smaller than the Trainer's)"
    return line
